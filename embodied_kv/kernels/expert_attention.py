"""The action expert's attention: H suffix queries over the prefix rows of an arena slot,
read in place, plus the suffix's own K/V; one joint softmax (pi0.5: the action tokens see
the whole prefix and each other, bidirectionally).

In torch (`expert_attention_ref`) this is 10 kernels per layer and Euler step (a permuted
copy of q, two score products, a concatenation, the masked scale, softmax, a cast, two
value products, a permuted copy back): 1,800 per action at pi05. Here it is two launches,
the split partials and decode_splitk's reduce (`FUSED_REDUCE`: one launch whose last split
per tile reduces measured 2.9x slower on an H200, so it is kept as an option).

RoPE on load (`rope=`, the chain's call, model/expert_step.py): q and the suffix k arrive as
the q/k/v GEMM wrote them and the partials rotate them, with kernels/rope.py's arithmetic
(the same bytes under the interpreter): one launch fewer per layer-step than a RoPE kernel
first. Each program rotates its q tile as it loads it, by halves (a swapped full-width
load beside the tables spilled at sm_90); the suffix programs rotate the H suffix keys
into a scratch of their own before the softmax state is live, then read them back.
Head dims of a power of two (pi05's 256); others are rotated by kernels/rope.py first.

Grid (cdiv(H, BLOCK_M), Hkv, NUM_SPLITS), flash-decoding style: program (b, h, j) takes
suffix tokens [b*BLOCK_M, (b+1)*BLOCK_M) x the GROUP query heads of KV head h as one
[BLOCK_M * GROUP_PAD, BLOCK_D] query tile (the prefill tile's shape, kernels/prefill_tile.py:
8 tokens x 8 heads at pi05). Split j < NUM_SPLITS - 1 runs the online softmax over its
chunk of the prefix rows (those whose mask entry is -inf neither loaded nor counted: rows
past the prefix length in a graph's row bucket; a chunk may hold none), the last split over
the H suffix rows; each writes its partial (max, sum, unnormalised output) and bumps its
tile's arrival counter; the program that arrives last combines the tile's partials as
decode_splitk's reduce does, in split order 0..NUM_SPLITS-1 (deterministic bytes), and resets
the counter to 0 (reusable workspace, graph replay without a memset). No program waits on
another (gemm_residual's hand-off). With fused_reduce=False the reduce is a second launch.
One program per tile walking the whole prefix took 83 us a call on an H100 (7 programs on
132 SMs at pi05; 180 calls per action).

Under the interpreter the fused output equals the two-kernel path's bytes (tested). On a GPU
the order of the split sum differs from the reduce kernel's tree (a few fp32 ulps), but the
fused path is deterministic. sm_90 (triton 3.9 offline compile, bf16, D 256, group 8, 4 warps,
2 stages; 32 / 16 splits): 227 / 235 registers, no spills, 64 KiB shared, wgmma (the partial
alone: 221); the combine walks D in 64-column chunks (whole-D: 255 registers, ~200 B spills).
Untimed and unraced on a device (no GPU here).

Supported range: as the prefill tile (fp32 / bf16 / fp16, D <= 256, group <= 32, any strides
with a contiguous last dim). Every output row sees the H >= 1 suffix keys, so the reduce
never divides by zero whatever the mask.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.decode_splitk import MAX_SPLITS, MIN_SPLITS, plan_reduce, workspace
from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.prefill_tile import tile_config, tile_constexprs
from embodied_kv.kernels.rope import check_tables, rope_on_load, rope_pair
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    LOG2E,
    MAX_GROUP,
    MAX_HEAD_DIM,
    Launch,
    pow2,
    tl,
    triton,
    use_kernel,
)


def expert_attention_ref(q, kp, vp, ks, vs, scale: float, bias: torch.Tensor) -> torch.Tensor:
    """Joint softmax over prefix rows and suffix tokens, without concatenating the prefix
    (LeRobot copies it every step; here it is read in place).

    Dtypes as LeRobot's eager attention under bf16: the score and value products in the
    model dtype (fp32 accumulation on the GPU), the masked softmax in fp32; the prefix K/V
    are never cast (an fp32 copy of them was 1.3 GB per action at pi05).

    q [H, Hq, D]; kp, vp [P, Hkv, D]; ks, vs [H, Hkv, D]; bias [P + H] fp32 (0 / -inf)
    -> [H, Hq, D] in q.dtype."""
    h_len, hq, d = q.shape
    hkv = kp.shape[1]
    g = hq // hkv
    n_p = kp.shape[0]
    qg = q.reshape(h_len, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, h_len * g, d)
    sp = torch.matmul(qg, kp.permute(1, 2, 0))  # [Hkv, H*g, P]
    ss = torch.matmul(qg, ks.permute(1, 2, 0))  # [Hkv, H*g, H]
    # bias + scale * s: masks, scales and (under bf16) casts to fp32 in one kernel
    p = torch.softmax(torch.add(bias, torch.cat([sp, ss], dim=-1), alpha=scale), dim=-1)
    p = p.to(q.dtype)
    o = torch.matmul(p[..., n_p:], vs.permute(1, 0, 2))  # [Hkv, H*g, D]
    o = torch.baddbmm(o, p[..., :n_p], vp.permute(1, 0, 2))
    return o.view(hkv, h_len, g, d).permute(1, 0, 2, 3).reshape(h_len, hq, d)


BLOCKS_PER_SPLIT = 4  # key blocks of the prefix per program (BLOCK_N 16: 64 rows)
# The reduce as its own launch (decode_splitk's), not by each tile's last split: timed on an
# H200 (bench/kernel_sweep.py, 2026-12-04, pi05 bf16, a 704-row bucket, 18 layers in one
# graph) the fused reduce took 39.4 us a call against 13.7 us for the two launches (16
# splits; 16.6 / 17.2 / 19.8 us at 1 / 2 / 8 key blocks per split, 8 warps or BLOCK_N 32
# slower): the 7 tiles' last programs each walk 16 partials of 64 x 256 fp32 alone, after
# the rest of the grid has finished. torch's chain: 30.8 us.
FUSED_REDUCE = False


def split_count(n_prefix: int, block_n: int) -> int:
    """Programs per (tile, KV head): NUM_SPLITS - 1 chunks of the prefix of about
    BLOCKS_PER_SPLIT key blocks each, plus one for the suffix; a power of two (the reduce
    kernel's tile), at most MAX_SPLITS. From shapes only: a graph's row bucket fixes it."""
    blocks = -(-n_prefix // block_n)
    return min(MAX_SPLITS, pow2(-(-blocks // BLOCKS_PER_SPLIT) + 1, MIN_SPLITS))


def chunk_blocks(n_prefix: int, block_n: int, splits: int) -> int:
    """Key blocks of BLOCK_N rows per prefix split (whole blocks; the last chunk may be short
    or empty)."""
    blocks = -(-n_prefix // block_n)
    return -(-blocks // (splits - 1))


if triton is not None:
    from embodied_kv.kernels.rope import rotated_rows
    from embodied_kv.kernels.triton_base import attend_block, load_kv_block

    @triton.jit
    def _combine_splits(
        m_ptr,  # [H, Hq, NUM_SPLITS] fp32 max per split
        l_ptr,  # [H, Hq, NUM_SPLITS] fp32 denominator per split
        acc_ptr,  # [H, Hq, NUM_SPLITS, D] fp32 unnormalised output per split
        out_ptr,  # [H, Hq, D] output
        tok,  # [ROWS] int64 suffix token of each tile row
        heads,  # [ROWS] query head of each tile row
        live_r,  # [ROWS] row is a real (token, head)
        n_heads,  # Hq
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        COMBINE_D: tl.constexpr,  # output columns combined at a time
    ):
        # decode_splitk's reduce for a whole tile, same operations in the same order: the
        # weighted outputs summed in split order 0, 1, ... (a loop, one [ROWS, COMBINE_D] tile
        # live), the denominators with tl.sum over the [ROWS, NUM_SPLITS] tile. Loads from L2
        # (.cg), where the other SMs' partials are.
        part = (tok * n_heads + heads) * NUM_SPLITS  # [ROWS] split 0's workspace row
        offs_s = tl.arange(0, NUM_SPLITS)
        m = tl.load(
            m_ptr + part[:, None] + offs_s[None, :],
            mask=live_r[:, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [ROWS, NUM_SPLITS]
        l_s = tl.load(
            l_ptr + part[:, None] + offs_s[None, :],
            mask=live_r[:, None],
            other=1.0,  # padded rows: a finite quotient, never stored
            cache_modifier=".cg",
        )
        m_max = tl.max(m, 1)  # finite: the suffix split sees H >= 1 keys
        denom = tl.sum(l_s * tl.exp2(m - m_max[:, None]), 1)
        # D in chunks of COMBINE_D columns: a whole [64, 256] fp32 total plus its loaded
        # partial is 256 registers a thread at 4 warps (sm_90: spills); a chunk is 1/4 of it
        for d0 in range(0, BLOCK_D, COMBINE_D):
            cols = d0 + tl.arange(0, COMBINE_D)
            mask = live_r[:, None] & (cols < HEAD_DIM)[None, :]
            total = tl.zeros([ROWS, COMBINE_D], dtype=tl.float32)
            for s in range(NUM_SPLITS):
                m_s = tl.load(m_ptr + part + s, mask=live_r, other=0.0, cache_modifier=".cg")
                a = tl.load(
                    acc_ptr + (part + s)[:, None] * HEAD_DIM + cols[None, :],
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                total += a * tl.exp2(m_s - m_max)[:, None]
            tl.store(
                out_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh + cols[None, :],
                (total / denom[:, None]).to(out_ptr.dtype.element_ty),
                mask=mask,
            )

    @triton.jit
    def _expert_attention_partial(
        q_ptr,  # [H, Hq, D] suffix queries
        kp_ptr,  # [P, Hkv, D] prefix keys: a slot's rows of one arena layer, in place
        vp_ptr,  # [P, Hkv, D] prefix values
        ks_ptr,  # [H, Hkv, D] suffix keys
        vs_ptr,  # [H, Hkv, D] suffix values
        bias_ptr,  # [P + H] fp32 mask: 0 (attend) or -inf; only the prefix part is read
        m_ptr,  # [H, Hq, NUM_SPLITS] fp32 out: max score per split (exp2 domain)
        l_ptr,  # [H, Hq, NUM_SPLITS] fp32 out: softmax denominator per split
        acc_ptr,  # [H, Hq, NUM_SPLITS, D] fp32 out: unnormalised output per split
        count_ptr,  # [tiles * Hkv] int32 arrivals per (tile, KV head), 0 between launches
        out_ptr,  # [H, Hq, D] output, q's dtype (FUSED_REDUCE only)
        cos_ptr,  # [H, 1, D] fp32 RoPE table [c, c] of the suffix tokens (ROPE only)
        sin_ptr,  # [H, 1, D] fp32 [-s, s] (ROPE only)
        stride_cn,  # cos / sin stride over tokens
        kr_ptr,  # [tiles, Hkv, H, D] q's dtype: each suffix program's rotated suffix keys (ROPE)
        stride_krt,  # its stride over tokens (D)
        h_len,  # H
        n_prefix,  # P
        chunk,  # prefix rows per split, a multiple of BLOCK_N
        qk_scale,  # softmax scale * log2(e)
        n_heads,  # Hq
        stride_qn,  # q stride over tokens (elements)
        stride_qh,  # q stride over heads
        stride_kpt,  # prefix k stride over rows
        stride_kph,  # prefix k stride over kv heads
        stride_vpt,  # prefix v stride over rows
        stride_vph,  # prefix v stride over kv heads
        stride_kst,  # suffix k stride over tokens
        stride_ksh,  # suffix k stride over kv heads
        stride_vst,  # suffix v stride over tokens
        stride_vsh,  # suffix v stride over kv heads
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        GROUP: tl.constexpr,  # Hq // Hkv
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
        BLOCK_M: tl.constexpr,  # suffix tokens per tile; BLOCK_M * GROUP_PAD >= 16
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= 16
        BLOCK_N: tl.constexpr,  # keys per online-softmax step
        NUM_SPLITS: tl.constexpr,  # prefix chunks + 1 (the suffix)
        SPLIT_P: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        FUSED_REDUCE: tl.constexpr,  # the last program of a tile combines the partials
        ROPE: tl.constexpr,  # q and the suffix k arrive unrotated: rotate them (D a power of 2)
        ROUND_BF16: tl.constexpr,  # the rotation rounds by hand (the interpreter truncates)
    ):
        # Grid (tiles, Hkv, NUM_SPLITS). Tile row r = (suffix token r // GROUP_PAD, query head
        # r % GROUP_PAD of KV head h); split j < NUM_SPLITS - 1 reads prefix rows
        # [j * chunk, (j + 1) * chunk), the last split the H suffix rows.
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        tok = tl.program_id(0).to(tl.int64) * BLOCK_M + offs_r // GROUP_PAD
        g = offs_r % GROUP_PAD
        mask_d = offs_d < HEAD_DIM
        live_r = (tok < h_len) & (g < GROUP)  # [ROWS]
        heads = kv_head * GROUP + g
        q_at = q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh
        # padded rows see q = 0: finite scores, no NaN
        if ROPE:  # as kernels/rope.py would have stored it: the same bytes
            q = rotated_rows(q_at, tok[:, None] * stride_cn, live_r[:, None], cos_ptr, sin_ptr,
                             HEAD_DIM // 2, ROUND_BF16)  # fmt: skip
            if split == NUM_SPLITS - 1:  # rotate the suffix keys into this program's scratch
                # before the softmax state is live (rotating them in the loop spilled at sm_90)
                tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
                kr_ptr += tile.to(tl.int64) * h_len * stride_krt
                for block in range(0, h_len, BLOCK_N):
                    rows = block + offs_n
                    live_k = (rows < h_len)[:, None]  # [BLOCK_N, 1]
                    k = rotated_rows(
                        ks_ptr + kv_head * stride_ksh + rows[:, None] * stride_kst,
                        rows[:, None] * stride_cn, live_k, cos_ptr, sin_ptr, HEAD_DIM // 2,
                        ROUND_BF16,
                    )  # fmt: skip
                    tl.store(kr_ptr + rows[:, None] * stride_krt + offs_d[None, :], k, mask=live_k)
                tl.debug_barrier()  # every thread's keys stored before any is read back
        else:
            q = tl.load(q_at + offs_d[None, :], mask=live_r[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        if split < NUM_SPLITS - 1:  # a chunk of the prefix; it may hold no admitted row
            kp_base = kp_ptr + kv_head * stride_kph
            vp_base = vp_ptr + kv_head * stride_vph
            start = split * chunk
            end = tl.minimum(start + chunk, n_prefix)
            for block in range(start, end, BLOCK_N):
                rows = block + offs_n
                b = tl.load(bias_ptr + rows, mask=rows < end, other=float("-inf"))
                # masked rows are not even loaded: whatever a bucket's tail holds (stale rows
                # of a language request, NaN) stays out of both products
                admitted = b == 0.0  # [BLOCK_N]
                k = tl.load(
                    kp_base + rows[None, :] * stride_kpt + offs_d[:, None],
                    mask=admitted[None, :] & mask_d[:, None],
                    other=0.0,
                )  # [BLOCK_D, BLOCK_N]
                v = tl.load(
                    vp_base + rows[:, None] * stride_vpt + offs_d[None, :],
                    mask=admitted[:, None] & mask_d[None, :],
                    other=0.0,
                )  # [BLOCK_N, BLOCK_D]
                m_i, l_i, acc = attend_block(
                    q, k, v, admitted[None, :], m_i, l_i, acc, qk_scale,
                    SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
        else:  # the suffix, bidirectional: every row sees H >= 1 keys, so m_i is finite
            ks_base = ks_ptr + kv_head * stride_ksh
            if ROPE:  # the rotated keys this program stored above
                ks_base = kr_ptr
                stride_kst = stride_krt
            vs_base = vs_ptr + kv_head * stride_vsh
            for block in range(0, h_len, BLOCK_N):
                rows = block + offs_n
                k, v = load_kv_block(
                    ks_base, vs_base, rows, h_len, offs_d, mask_d, stride_kst, stride_vst
                )
                valid = (rows < h_len)[None, :]
                m_i, l_i, acc = attend_block(
                    q, k, v, valid, m_i, l_i, acc, qk_scale,
                    SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
        part = (tok * n_heads + heads) * NUM_SPLITS + split  # [ROWS] rows of the workspace
        tl.store(m_ptr + part, m_i, mask=live_r)
        tl.store(l_ptr + part, l_i, mask=live_r)
        tl.store(
            acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=live_r[:, None] & mask_d[None, :],
        )
        if FUSED_REDUCE:
            # as gemm_residual: every thread's partial stored before the one atomic releases
            # them (gpu scope); its acquire and the barrier handing out its result order the
            # loads below. The last arrival combines; nobody waits.
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                _combine_splits(
                    m_ptr, l_ptr, acc_ptr, out_ptr, tok, heads, live_r, n_heads, stride_on,
                    stride_oh, BLOCK_M * GROUP_PAD, HEAD_DIM, BLOCK_D, NUM_SPLITS,
                    min(BLOCK_D, 64),
                )  # fmt: skip
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


def expert_workspace(h_len: int, hq: int, hkv: int, d: int, n_prefix: int, dtype, device):
    """(m, l, acc, counters) for `plan_expert_attention`: decode_splitk's partials for the
    shape's split count, plus [tiles * Hkv] int32 zeros (the fused reduce's arrivals).

    Allocate once per shape (a graph's row bucket) and reuse: the fused kernel leaves the
    counters at 0, while a fresh workspace is a memset launch. Calls sharing one must run in
    order on one stream."""
    cfg = tile_config(dtype, hq // hkv)
    splits = split_count(n_prefix, cfg.block_n)
    tiles = -(-h_len // cfg.block_m) * hkv
    count = torch.zeros(tiles, dtype=torch.int32, device=device)
    return (*workspace(h_len, hq, d, splits, device), count)


def check_workspace(work, h_len: int, hq: int, hkv: int, d: int, n_prefix: int, dtype) -> None:
    """ValueError unless `work` is an `expert_workspace` for these shapes (another shape's
    would be indexed out of its bounds)."""
    cfg = tile_config(dtype, hq // hkv)
    splits = split_count(n_prefix, cfg.block_n)
    want = (
        (h_len, hq, splits),
        (h_len, hq, splits),
        (h_len, hq, splits, d),
        (-(-h_len // cfg.block_m) * hkv,),
    )
    got = tuple(tuple(t.shape) for t in work) if len(work) == 4 else None
    dtypes = [t.dtype for t in work] if got is not None else None
    if got != want or dtypes != [torch.float32] * 3 + [torch.int32]:
        raise ValueError(f"work: expected an expert_workspace of shapes {want}, got {got}")


def plan_expert_attention(
    q, kp, vp, ks, vs, scale: float, bias, out, work=None, fused_reduce: bool = FUSED_REDUCE,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Launch]:  # fmt: skip
    """The launches of an expert attention call (inputs already validated; `meta` tensors
    work): one kernel whose last split of each tile reduces (fused_reduce), else the split
    partials then decode_splitk's reduce over them (same workspace layout, counters unused).
    `work`: an `expert_workspace(...)`, allocated here if None. `rope`: (cos, sin) [H, 1, D]
    fp32 (`Rope.at` of the suffix): q and ks arrive unrotated and are rotated as loaded."""
    h_len, hq, d = q.shape
    n_p, hkv = kp.shape[0], kp.shape[1]
    group = hq // hkv
    cfg = tile_config(q.dtype, group)
    splits = split_count(n_p, cfg.block_n)
    chunk = chunk_blocks(n_p, cfg.block_n, splits) * cfg.block_n  # prefix rows per split
    if work is None:
        work = expert_workspace(h_len, hq, hkv, d, n_p, q.dtype, q.device)
    m, l_s, acc, count = work
    tag = f"{str(q.dtype).removeprefix('torch.')} D={d} group={group} splits={splits}"
    name = "expert_attention_fused" if fused_reduce else "expert_attention"
    cos, sin = rope if rope is not None else (bias, bias)  # never read without ROPE
    # the suffix programs' rotated keys (ROPE): one [H, D] scratch each, held by the graph
    tiles = -(-h_len // cfg.block_m) * hkv
    kr = q.new_empty(tiles, h_len, d) if rope is not None else q  # never read without ROPE
    args = (
        q, kp, vp, ks, vs, bias, m, l_s, acc, count, out, cos, sin,
        cos.stride(0) if rope is not None else 0, kr, d, h_len, n_p, chunk, scale * LOG2E, hq,
        q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    partial = Launch(
        name=f"{name}{'_rope' if rope is not None else ''} {tag} block_m={cfg.block_m} "
        f"block_n={cfg.block_n}",
        kernel=_expert_attention_partial,
        grid=(-(-h_len // cfg.block_m), hkv, splits),
        args=args,
        constexprs={
            **tile_constexprs(cfg, group, d, q.dtype),
            "NUM_SPLITS": splits,
            "FUSED_REDUCE": fused_reduce,
            "ROPE": rope is not None,
            "ROUND_BF16": INTERPRETED and q.dtype == torch.bfloat16,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if fused_reduce:
        return [partial]
    return [partial, plan_reduce(m, l_s, acc, out, f"expert_reduce {tag}")]


def expert_attention_kernel(
    q, kp, vp, ks, vs, scale: float, bias, work=None, fused_reduce: bool = FUSED_REDUCE,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); `work`: an
    `expert_workspace` kept by the caller, else one is allocated per call; `rope`: see
    `plan_expert_attention`."""
    if triton is None:
        raise RuntimeError("the expert attention kernel needs triton, which is not installed")
    h_len, hq, d = q.shape
    n_p, hkv = kp.shape[0], kp.shape[1]
    if d > MAX_HEAD_DIM or hq % hkv or hq // hkv > MAX_GROUP:
        raise RuntimeError(
            f"expert attention kernel: head_dim {d} (<= {MAX_HEAD_DIM}), heads {hq} / {hkv} "
            f"(a group <= {MAX_GROUP}) unsupported"
        )
    shapes = {"kp": kp, "vp": vp, "ks": ks, "vs": vs}
    want = {"kp": (n_p, hkv, d), "vp": (n_p, hkv, d), "ks": (h_len, hkv, d), "vs": (h_len, hkv, d)}
    for name, t in shapes.items():
        if tuple(t.shape) != want[name] or t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(
                f"{name}: expected {q.dtype} {want[name]} with a contiguous last dim, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    if bias.shape != (n_p + h_len,) or bias.dtype != torch.float32:
        raise ValueError(
            f"bias: expected fp32 [{n_p + h_len}], got {bias.dtype} {tuple(bias.shape)}"
        )
    if work is not None:
        check_workspace(work, h_len, hq, hkv, d, n_p, q.dtype)
    if rope is not None:
        check_rope(rope, h_len, d)
    out = torch.empty(h_len, hq, d, dtype=q.dtype, device=q.device)
    for launch in plan_expert_attention(
        q, kp, vp, ks, vs, scale, bias, out, work, fused_reduce, rope
    ):
        launch.run()
    return out


def check_rope(rope, h_len: int, d: int) -> None:
    """ValueError unless `rope` is (cos, sin), fp32 [H, 1, D] with one token stride and a
    contiguous last dim: `Rope.at` of the suffix positions, whose layout the kernel assumes
    ([c, c] and [-s, s]; not checked, a check would read the device). RuntimeError for a D
    the kernel does not rotate (`rope_on_load`)."""
    if not rope_on_load(d):
        raise RuntimeError(f"rope on load: head_dim {d} is not a power of two")
    check_tables(*rope, h_len, d, "expert attention rope")


def expert_attention(q, kp, vp, ks, vs, scale: float, bias, work=None, rope=None) -> torch.Tensor:
    """Dispatch: the Triton kernel (partials + reduce, FUSED_REDUCE) on CUDA, the reference
    elsewhere. `work`: an `expert_workspace` for these shapes, reused across calls. `rope`:
    (cos, sin) [H, 1, D] fp32 when q and ks are not rotated yet: the kernel rotates them as
    it loads them (no RoPE launch); the reference path rotates first (kernels/rope.py
    rope_pair), the chain's ops and bytes."""
    kernel = use_kernel(q, kp, vp, ks, vs)
    if rope is not None and not (kernel and rope_on_load(q.shape[-1])):
        q, ks = rope_pair(q, ks, *rope)  # one kernel on CUDA where q, k are adjacent heads
        rope = None
    if kernel:
        out = try_kernel("expert_attention", expert_attention_kernel, q, kp, vp, ks, vs, scale,
                         bias, work, FUSED_REDUCE, rope)  # fmt: skip
        if out is not None:
            return out
    if rope is not None:  # the kernel failed: the reference path rotates first
        q, ks = rope_pair(q, ks, *rope)
    return expert_attention_ref(q, kp, vp, ks, vs, scale, bias)
