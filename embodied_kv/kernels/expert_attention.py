"""The action expert's attention: H suffix queries over the prefix rows of an arena slot,
read in place, plus the suffix's own K/V; one joint softmax (pi0.5: the action tokens see
the whole prefix and each other, bidirectionally).

In torch (`expert_attention_ref`) this is 10 kernels per layer and Euler step (a permuted
copy of q, two score products, a concatenation, the masked scale, softmax, a cast, two
value products, a permuted copy back): 1,800 per action at pi05. Here the split partials
and their reduce, in one of three forms (`REDUCE`): "launch", two launches (the partials,
then decode_splitk's reduce; the fastest an H200 timed); "last", one launch whose last split
per tile reduces (2.9x slower on that H200: 7 programs walk all the partials alone); "queue",
one persistent launch (kernels/work_queue.py): a program per SM takes the partial items,
then the reduce items, each combining QUEUE_COLS columns of a tile once the tile's splits
have arrived. The queue is the two launches' work and parallelism without the launch
between them; untimed on a GPU (`bench latency`'s graphs_prev runs "launch").

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
the H suffix rows; each writes its partial (max, sum, unnormalised output). "last" and
"queue" count each tile's arrivals; whoever combines does it as decode_splitk's reduce does,
in split order 0..NUM_SPLITS-1 (deterministic bytes: kernels/expert_combine.py), and the
counters go back to 0 (reusable workspace, graph replay without a memset). One program per
tile walking the whole prefix took 83 us a call on an H100 (7 programs on 132 SMs at pi05;
180 calls per action).

Under the interpreter every form gives the two-kernel path's bytes (tested). On a GPU
the order of the split sum differs from the reduce kernel's tree (a few fp32 ulps), but
"last" and "queue" are deterministic. sm_90 (triton 3.9 offline compile, bf16, D 256,
group 8, 4 warps, 2 stages, 32 splits; registers without / with RoPE, no spills, 64 KiB
shared, wgmma): "launch" 221 / 254 (its reduce 43), "queue" 230 / 255 (its reduce item a
call); the combine walks D in chunks (whole-D: 255 registers, ~200 B spills). Untimed and
unraced on a device.

Supported range: as the prefill tile (fp32 / bf16 / fp16, D <= 256, group <= 32, any strides
with a contiguous last dim). Every output row sees the H >= 1 suffix keys, so the reduce
never divides by zero whatever the mask.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.decode_splitk import MAX_SPLITS, MIN_SPLITS, plan_reduce, workspace
from embodied_kv.kernels.expert_combine import QUEUE_COLS, reduce_items
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
from embodied_kv.kernels.work_queue import MAX_SPINS, QUEUE_WORDS, programs


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
# the rest of the grid has finished. torch's chain: 30.8 us. "queue" (untimed): one
# persistent launch whose reduce items spread each tile's combine over QUEUE_COLS-column
# chunks, with no launch between (kernels/work_queue.py): the two launches' work in one.
REDUCES = ("launch", "last", "queue")
REDUCE = "queue"


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
    from embodied_kv.kernels.expert_combine import combine_splits, reduce_item
    from embodied_kv.kernels.expert_tile import attend_tile, attend_tile_call, rotate_keys
    from embodied_kv.kernels.work_queue import arrive, finish, grab, wait_for

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
        count_ptr,  # int32 [2T + Hkv + 2] (T tiles x Hkv), 0 between launches: arrivals and
        # reduce items done per tile, rotated keys per KV head, the queue's next item and flag
        out_ptr,  # [H, Hq, D] output, q's dtype (FUSED_REDUCE, QUEUE)
        cos_ptr,  # [H, 1, D] fp32 RoPE table [c, c] of the suffix tokens (ROPE only)
        sin_ptr,  # [H, 1, D] fp32 [-s, s] (ROPE only)
        stride_cn,  # cos / sin stride over tokens
        kr_ptr,  # q's dtype, contiguous: rotated suffix keys (ROPE), [T, H, D] a tile each
        # (the grid), [Hkv, H, D] (QUEUE)
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
        max_spins,  # QUEUE: polls before a wait gives up (kernels/work_queue.py)
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
        QUEUE: tl.constexpr,  # a persistent grid taking the items below
        REDUCE_ITEMS: tl.constexpr,  # QUEUE: reduce items per tile (QUEUE_COLS columns each)
        QUEUE_COLS: tl.constexpr,
        ROPE: tl.constexpr,  # q and the suffix k arrive unrotated: rotate them (D a power of 2)
        ROUND_BF16: tl.constexpr,  # the rotation rounds by hand (the interpreter truncates)
    ):
        # Grid (tiles, Hkv, NUM_SPLITS); or with QUEUE a persistent grid over the items, in
        # dependency order: with ROPE a key rotation per KV head, then the T x NUM_SPLITS
        # partials (tile-major; the suffix splits wait for their head's keys), then T x
        # REDUCE_ITEMS reduces (each waits for its tile's NUM_SPLITS arrivals)
        n_kv = n_heads // GROUP
        n_tiles = tl.cdiv(h_len, BLOCK_M) * n_kv  # T: (tile, KV head) pairs
        if QUEUE:
            keys_ptr = count_ptr + 2 * n_tiles  # arrivals of each KV head's rotated keys
            queue_ptr = keys_ptr + n_kv
            n_rot = n_kv if ROPE else 0
            n_part = n_rot + n_tiles * NUM_SPLITS
            n_items = n_part + n_tiles * REDUCE_ITEMS
            item = grab(queue_ptr)
            while item < n_items:
                if item < n_rot:
                    rotate_keys(ks_ptr + item * stride_ksh, kr_ptr + item * h_len * stride_krt,
                                 cos_ptr, sin_ptr, stride_cn, stride_kst, stride_krt, h_len,
                                 HEAD_DIM, BLOCK_N, ROUND_BF16)  # fmt: skip
                    arrive(keys_ptr + item)
                elif item < n_part:
                    tk = (item - n_rot) // NUM_SPLITS
                    split = (item - n_rot) % NUM_SPLITS
                    kv_head = tk % n_kv
                    if ROPE:
                        if split == NUM_SPLITS - 1:
                            wait_for(keys_ptr + kv_head, 1, queue_ptr + 1, max_spins)
                    attend_tile_call(
                        tk // n_kv, kv_head, split, q_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr,
                        bias_ptr, m_ptr, l_ptr, acc_ptr, cos_ptr, sin_ptr, stride_cn,
                        kr_ptr, kv_head, stride_krt, h_len, n_prefix, chunk, qk_scale,
                        n_heads, stride_qn, stride_qh, stride_kpt, stride_kph, stride_vpt,
                        stride_vph, stride_kst, stride_ksh, stride_vst, stride_vsh, GROUP,
                        GROUP_PAD, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_SPLITS, SPLIT_P,
                        DOT_IN_FP32, INPUT_PRECISION, ROPE, False, ROUND_BF16,
                    )  # fmt: skip
                    arrive(count_ptr + tk)
                else:
                    reduce_item(
                        m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr,
                        (item - n_part) // REDUCE_ITEMS, (item - n_part) % REDUCE_ITEMS,
                        n_tiles, n_kv, h_len, n_heads, stride_on, stride_oh, queue_ptr + 1,
                        max_spins, GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM, NUM_SPLITS,
                        REDUCE_ITEMS, QUEUE_COLS,
                    )  # fmt: skip
                item = grab(queue_ptr)
            finish(queue_ptr, item, n_items, keys_ptr, n_rot)  # the key arrivals and queue
        else:
            attend_tile(
                tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, kp_ptr, vp_ptr,
                ks_ptr, vs_ptr, bias_ptr, m_ptr, l_ptr, acc_ptr, cos_ptr, sin_ptr, stride_cn,
                kr_ptr, 0, stride_krt, h_len, n_prefix, chunk,
                qk_scale, n_heads, stride_qn, stride_qh, stride_kpt, stride_kph, stride_vpt,
                stride_vph, stride_kst, stride_ksh, stride_vst, stride_vsh, GROUP, GROUP_PAD,
                BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_SPLITS, SPLIT_P, DOT_IN_FP32,
                INPUT_PRECISION, ROPE, True, ROUND_BF16,
            )  # fmt: skip
            if FUSED_REDUCE:
                # as gemm_residual: the last arrival of a tile combines; nobody waits
                tile = tl.program_id(0) * n_kv + tl.program_id(1)
                if arrive(count_ptr + tile) == NUM_SPLITS - 1:
                    combine_splits(
                        m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0), tl.program_id(1),
                        h_len, n_heads, stride_on, stride_oh, 0, GROUP, GROUP_PAD, BLOCK_M,
                        HEAD_DIM, NUM_SPLITS, BLOCK_D, min(BLOCK_D, 64),  # COMBINE_D
                    )  # fmt: skip
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


def expert_workspace(h_len: int, hq: int, hkv: int, d: int, n_prefix: int, dtype, device):
    """(m, l, acc, counters) for `plan_expert_attention`: decode_splitk's partials for the
    shape's split count, plus int32 zeros [2T + Hkv + 2] for T = tiles x Hkv: arrivals per
    tile, reduce items done per tile, rotated keys per KV head, and the queue's next item and
    error flag (`work_queue.failed(counters[-2:])`).

    Allocate once per shape (a graph's row bucket) and reuse: the fused and queued kernels
    leave the counters at 0, while a fresh workspace is a memset launch. Calls sharing one
    must run in order on one stream."""
    cfg = tile_config(dtype, hq // hkv)
    splits = split_count(n_prefix, cfg.block_n)
    tiles = -(-h_len // cfg.block_m) * hkv
    count = torch.zeros(2 * tiles + QUEUE_WORDS + hkv, dtype=torch.int32, device=device)
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
        (2 * -(-h_len // cfg.block_m) * hkv + QUEUE_WORDS + hkv,),
    )
    got = tuple(tuple(t.shape) for t in work) if len(work) == 4 else None
    dtypes = [t.dtype for t in work] if got is not None else None
    if got != want or dtypes != [torch.float32] * 3 + [torch.int32]:
        raise ValueError(f"work: expected an expert_workspace of shapes {want}, got {got}")


def plan_expert_attention(
    q, kp, vp, ks, vs, scale: float, bias, out, work=None, reduce: str = REDUCE,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None, max_spins: int = MAX_SPINS,
) -> list[Launch]:  # fmt: skip
    """The launches of an expert attention call (inputs already validated; `meta` tensors
    work), by `reduce` (REDUCES): "launch", the split partials then decode_splitk's reduce
    over them; "last", one kernel whose last split of each tile reduces; "queue", one
    persistent kernel (a program per SM) taking the partials, then the reduce items.
    `work`: an `expert_workspace(...)`, allocated here if None. `rope`: (cos, sin) [H, 1, D]
    fp32 (`Rope.at` of the suffix): q and ks arrive unrotated and are rotated as loaded."""
    if reduce not in REDUCES:
        raise ValueError(f"reduce: one of {REDUCES}, got {reduce!r}")
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
    name = {"launch": "expert_attention", "last": "expert_attention_fused",
            "queue": "expert_attention_queue"}[reduce]  # fmt: skip
    cos, sin = rope if rope is not None else (bias, bias)  # never read without ROPE
    # the rotated suffix keys (ROPE): a [H, D] scratch a tile (the grid) or a KV head (the
    # queue: rotated once, by an item), held by the graph
    tiles = -(-h_len // cfg.block_m) * hkv
    scratch = hkv if reduce == "queue" else tiles
    kr = q.new_empty(scratch, h_len, d) if rope is not None else q  # never read without ROPE
    args = (
        q, kp, vp, ks, vs, bias, m, l_s, acc, count, out, cos, sin,
        cos.stride(0) if rope is not None else 0, kr, d, h_len, n_p, chunk, scale * LOG2E, hq,
        q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), out.stride(0), out.stride(1),
        max_spins,
    )  # fmt: skip
    items = tiles * (splits + reduce_items(pow2(d))) + (hkv if rope is not None else 0)
    grid = (programs(items, q.device),) if reduce == "queue" else (tiles // hkv, hkv, splits)
    partial = Launch(
        name=f"{name}{'_rope' if rope is not None else ''} {tag} block_m={cfg.block_m} "
        f"block_n={cfg.block_n}",
        kernel=_expert_attention_partial,
        grid=grid,
        args=args,
        constexprs={
            **tile_constexprs(cfg, group, d, q.dtype),
            "NUM_SPLITS": splits,
            "FUSED_REDUCE": reduce == "last",
            "QUEUE": reduce == "queue",
            "REDUCE_ITEMS": reduce_items(pow2(d)),
            "QUEUE_COLS": QUEUE_COLS,
            "ROPE": rope is not None,
            "ROUND_BF16": INTERPRETED and q.dtype == torch.bfloat16,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if reduce != "launch":
        return [partial]
    return [partial, plan_reduce(m, l_s, acc, out, f"expert_reduce {tag}")]


def expert_attention_kernel(
    q, kp, vp, ks, vs, scale: float, bias, work=None, reduce: str = REDUCE,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None, max_spins: int = MAX_SPINS,
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
        q, kp, vp, ks, vs, scale, bias, out, work, reduce, rope, max_spins
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
    """Dispatch: the Triton kernel (partials + reduce, as REDUCE says) on CUDA, the reference
    elsewhere. `work`: an `expert_workspace` for these shapes, reused across calls. `rope`:
    (cos, sin) [H, 1, D] fp32 when q and ks are not rotated yet: the kernel rotates them as
    it loads them (no RoPE launch); the reference path rotates first (kernels/rope.py
    rope_pair), the chain's ops and bytes. Where Triton cannot build REDUCE's form (the
    queue's, the newest), the two launches run: the measured form, not the reference."""
    kernel = use_kernel(q, kp, vp, ks, vs)
    if rope is not None and not (kernel and rope_on_load(q.shape[-1])):
        q, ks = rope_pair(q, ks, *rope)  # one kernel on CUDA where q, k are adjacent heads
        rope = None
    for form in dict.fromkeys((REDUCE, "launch")) if kernel else ():
        op = "expert_attention" if form == "launch" else f"expert_attention_{form}"
        out = try_kernel(op, expert_attention_kernel, q, kp, vp, ks, vs, scale, bias, work,
                         form, rope)  # fmt: skip
        if out is not None:
            return out
    if rope is not None:  # the kernel failed: the reference path rotates first
        q, ks = rope_pair(q, ks, *rope)
    return expert_attention_ref(q, kp, vp, ks, vs, scale, bias)
