"""Split-K (flash-decoding) packed attention: the decode-shaped access pattern.

A decode step has a few tokens, each reading a whole slot: one program per (token, KV head)
would leave a batch-1 decode on 1 of 132 SMs. Here each token's rows [0, kv_len) are cut into
NUM_SPLITS chunks read by separate programs, which write partial (max, sum, unnormalised
output) to a workspace; a small reduce kernel combines them. Same contract as
`packed_attention_ref` (kernels/packed_attention.py); inputs are validated there.

Supported range: q / k / v fp32, bf16 or fp16 (one dtype), head_dim <= 256 (padded to a power
of two >= 16 with masks), Hq / Hkv <= 32, any strides with a contiguous last dim, slots in any
order, any mix of tokens (correct for a prefill too, but it reads the slot once per token).
Preconditions not checked (a check would sync the device): 1 <= kv_len[i] <= T, 0 <= slot < S.

CUDA graphs: the grid is (N, Hkv, NUM_SPLITS) with NUM_SPLITS fixed by the arena's T, never by
kv_len, which stays on the device; each program derives its chunk from kv_len and masks the
rest, so a chunk past kv_len is an empty split (it writes max = -inf, sum = 0, output = 0 and
the reduce gives it weight 0). Chunking depends only on (kv_len, NUM_SPLITS), never on the other
tokens: a token's output is the same bytes whatever shares its step (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels.triton_base import LOG2E, Launch, pow2, precision_flags, tl, triton

MAX_SPLITS = 32  # bounds the reduce kernel's [NUM_SPLITS, BLOCK_D] fp32 tile (64 regs at D=256)
MIN_SPLITS = 2  # tl.arange needs a power of two; 2 keeps the reduce tile 2-D


@dataclass(frozen=True)
class SplitKConfig:
    block_n: int  # keys per online-softmax step; also the granularity of a split's chunk
    num_splits: int  # chunks per (token, KV head), a power of two
    num_warps: int
    num_stages: int
    reduce_warps: int


def splitk_config(dtype: torch.dtype, max_len: int) -> SplitKConfig:
    """The configuration for an arena of `max_len` rows per slot.

    Enough splits that a chunk of the longest slot is about one BLOCK_N step, at most
    MAX_SPLITS: at pi05 (T ~ 1-2k rows) a batch-1 decode then runs 16-32 programs per layer."""
    # fp32 (ieee dots on CUDA cores) spills at BLOCK_N = 64, D = 256; 32 does not (ptxas, sm_90).
    block_n = 32 if dtype == torch.float32 else 64
    splits = min(MAX_SPLITS, pow2(-(-max_len // block_n), MIN_SPLITS))
    return SplitKConfig(block_n, splits, num_warps=4, num_stages=2, reduce_warps=4)


def workspace(n_tok: int, hq: int, d: int, num_splits: int, device) -> tuple[torch.Tensor, ...]:
    """Partials of one step: max and sum [N, Hq, NUM_SPLITS], output [N, Hq, NUM_SPLITS, D], fp32.

    Allocate once per graph bucket and pass to every layer's call (the layers run in order)."""
    f32 = {"dtype": torch.float32, "device": device}
    return (
        torch.empty(n_tok, hq, num_splits, **f32),
        torch.empty(n_tok, hq, num_splits, **f32),
        torch.empty(n_tok, hq, num_splits, d, **f32),
    )


if triton is not None:
    from embodied_kv.kernels.triton_base import attend_block, load_kv_block

    @triton.jit
    def _splitk_partial(
        q_ptr,  # [N, Hq, D] queries
        k_ptr,  # [S, T, Hkv, D] keys of one layer of the arena
        v_ptr,  # [S, T, Hkv, D] values, same layout as keys
        slot_ptr,  # [N] int slot of each token
        kv_len_ptr,  # [N] int number of rows of its slot each token reads
        m_ptr,  # [N, Hq, NUM_SPLITS] fp32 out: max score per split (exp2 domain)
        l_ptr,  # [N, Hq, NUM_SPLITS] fp32 out: softmax denominator per split
        acc_ptr,  # [N, Hq, NUM_SPLITS, D] fp32 out: unnormalised output per split
        qk_scale,  # softmax scale * log2(e)
        n_heads,  # Hq
        stride_qn,  # q stride over tokens (elements)
        stride_qh,  # q stride over heads
        stride_ks,  # k stride over slots
        stride_kt,  # k stride over rows
        stride_kh,  # k stride over kv heads
        stride_vs,  # v stride over slots
        stride_vt,  # v stride over rows
        stride_vh,  # v stride over kv heads
        GROUP: tl.constexpr,  # Hq // Hkv
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= 16
        BLOCK_N: tl.constexpr,  # keys per online-softmax step
        NUM_SPLITS: tl.constexpr,  # chunks per (token, KV head)
        SPLIT_P: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # Grid (N, Hkv, NUM_SPLITS): program (i, h, j) reads chunk j of token i's slot rows for
        # the GROUP query heads sharing KV head h, as one [GROUP_PAD, BLOCK_D] tile (each K/V
        # row is loaded once for the whole group).
        tok = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        s = tl.load(slot_ptr + tok).to(tl.int64)
        n_keys = tl.load(kv_len_ptr + tok).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(n_keys, BLOCK_N), NUM_SPLITS) * BLOCK_N  # whole blocks per split
        start = split * chunk
        end = tl.minimum(start + chunk, n_keys)  # start >= end: an empty split

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        q = tl.load(
            q_ptr + tok * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        )  # [GROUP_PAD, BLOCK_D]; padded group rows see q = 0: finite scores, no NaN
        k_base = k_ptr + s * stride_ks + kv_head * stride_kh
        v_base = v_ptr + s * stride_vs + kv_head * stride_vh

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for block in range(start, end, BLOCK_N):
            rows = block + offs_n  # every block holds >= 1 row < end: m_i stays finite
            k, v = load_kv_block(k_base, v_base, rows, end, offs_d, mask_d, stride_kt, stride_vt)
            m_i, l_i, acc = attend_block(
                q, k, v, (rows < end)[None, :], m_i, l_i, acc, qk_scale,
                SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
            )  # fmt: skip

        part = (tok * n_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD] row of the workspace
        tl.store(m_ptr + part, m_i, mask=mask_g)
        tl.store(l_ptr + part, l_i, mask=mask_g)
        tl.store(
            acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=mask_g[:, None] & mask_d[None, :],
        )

    @triton.jit
    def _splitk_reduce(
        m_ptr,  # [N, Hq, NUM_SPLITS] fp32 max per split
        l_ptr,  # [N, Hq, NUM_SPLITS] fp32 denominator per split
        acc_ptr,  # [N, Hq, NUM_SPLITS, D] fp32 unnormalised output per split
        out_ptr,  # [N, Hq, D] output
        n_heads,  # Hq
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        # Grid (N, Hq): one program per (token, query head) combines its NUM_SPLITS partials.
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        part = (tok * n_heads + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
        m = tl.load(m_ptr + part)
        l_s = tl.load(l_ptr + part)
        acc = tl.load(
            acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_d[None, :], other=0.0
        )  # [NUM_SPLITS, BLOCK_D]
        m_max = tl.max(m, 0)  # finite: split 0 always holds row 0
        w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0 (and their sum and output are 0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(
            out_ptr + tok * stride_on + head * stride_oh + offs_d,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )


def plan_splitk(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [S, T, Hkv, D]
    v_cache: torch.Tensor,
    slot: torch.Tensor,  # [N]
    kv_len: torch.Tensor,  # [N]
    scale: float,
    out: torch.Tensor,  # [N, Hq, D], written by the reduce kernel
    work: tuple[torch.Tensor, ...] | None = None,  # from `workspace`; allocated here if None
    num_splits: int | None = None,  # override the configuration's (tests: many empty splits)
) -> list[Launch]:
    """The two launches of one split-K attention call (inputs already validated)."""
    n_tok, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    cfg = splitk_config(q.dtype, k_cache.shape[1])
    splits = cfg.num_splits if num_splits is None else num_splits
    if splits < MIN_SPLITS or splits & (splits - 1) or splits > MAX_SPLITS:
        raise ValueError(f"num_splits={splits} must be a power of two in [2, {MAX_SPLITS}]")
    if work is None:
        work = workspace(n_tok, hq, d, splits, q.device)
    m, l_s, acc = work
    if m.shape != (n_tok, hq, splits) or acc.shape != (n_tok, hq, splits, d):
        raise ValueError(
            f"workspace {tuple(m.shape)}, {tuple(acc.shape)} does not fit N={n_tok}, Hq={hq}, "
            f"splits={splits}, D={d}"
        )
    tag = f"{str(q.dtype).removeprefix('torch.')} D={d} group={group} splits={splits}"
    partial = Launch(
        name=f"splitk_partial {tag} block_n={cfg.block_n}",
        kernel=_splitk_partial,
        grid=(n_tok, hkv, splits),
        args=(
            q,
            k_cache,
            v_cache,
            slot,
            kv_len,
            m,
            l_s,
            acc,
            scale * LOG2E,
            hq,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
        ),
        constexprs={
            "GROUP": group,
            "GROUP_PAD": pow2(group),
            "HEAD_DIM": d,
            "BLOCK_D": pow2(d),
            "BLOCK_N": cfg.block_n,
            "NUM_SPLITS": splits,
            **precision_flags(q.dtype),
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return [partial, plan_reduce(m, l_s, acc, out, f"splitk_reduce {tag}", cfg.reduce_warps)]


def plan_reduce(m, l_s, acc, out, name: str, num_warps: int = 4) -> Launch:
    """The reduce launch over a split workspace (m, l [N, Hq, S], acc [N, Hq, S, D]) into
    out [N, Hq, D]; at least one split of every (token, head) must hold a key."""
    n_tok, hq, splits, d = acc.shape
    return Launch(
        name=name,
        kernel=_splitk_reduce,
        grid=(n_tok, hq),
        args=(m, l_s, acc, out, hq, out.stride(0), out.stride(1)),
        constexprs={"HEAD_DIM": d, "BLOCK_D": pow2(d), "NUM_SPLITS": splits},
        num_warps=num_warps,
        num_stages=1,
    )
