"""Packed attention: one flat batch of new tokens, each reading its own slot of the arena.

Contract (shared by the reference and the Triton kernel):

    q        [N, Hq, D]      queries of the new tokens (RoPE applied)
    k_cache  [S, T, Hkv, D]  one layer of the arena; the new tokens' K are already written
    v_cache  [S, T, Hkv, D]
    slot     [N] int64       the slot each token belongs to
    kv_len   [N] int64       token i attends to rows [0, kv_len[i]) of k_cache[slot[i]]
    out      [N, Hq, D]      in q.dtype, accumulated in fp32

Causal decode, a bidirectional prefix and mixed batches differ only in kv_len, which
the step planner (kv/step.py) computes. Hq must be a multiple of Hkv (MQA / GQA).

The reference is also the CPU hot path, so it is written to be batch-invariant: the
result for a token does not depend on which other tokens share the step. CPU fp32
GEMMs round differently for small row counts: measured here (torch 2.13 CPU, one
thread, every GEMM shape of the tiny preset, `bench step` records the probe) rows
1..3 disagree with >= 4 rows, and an earlier torch build disagreed at 1..11 except 4
and 8, so the multiples of ROW_BUCKET = 4 agree on both. A step is padded once to a
multiple of ROW_BUCKET tokens (kv/step.py); inside attention a run of n tokens of one
slot is a [n * group, D] GEMM, padded only where n * group < ROW_BUCKET. Runs with the
same (tokens, key bucket) go through one batched GEMM (a batch entry rounds as it does
alone) and keys are padded to a multiple of KEY_BLOCK; masked keys contribute exact
zeros. So a decode of B slots is a few batched GEMMs, not B padded ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference; the kernel wrapper says why it can't
    triton = None

ROW_BUCKET = 4  # tokens per step and GEMM rows per run are padded to a multiple of this
KEY_BLOCK = 64  # keys per run are padded to a multiple of this

Run = tuple[int, int, int]  # (slot, first token index, number of tokens)


def bucket(n: int, size: int = ROW_BUCKET) -> int:
    """Smallest multiple of `size` that holds n (at least one bucket)."""
    return max(size, -(-n // size) * size)


def run_rows(n: int, group: int) -> int:
    """Query rows a run of n tokens is padded to, so that its [rows * group, D] GEMM has a
    batch-invariant row count (a multiple of ROW_BUCKET): n itself whenever group is."""
    rows = n
    while (rows * group) % ROW_BUCKET:
        rows += 1
    return rows


def contiguous_runs(slot: torch.Tensor) -> list[Run]:
    """Split a flat slot vector into runs of equal consecutive slots (host sync)."""
    values, counts = torch.unique_consecutive(slot.cpu(), return_counts=True)
    runs, start = [], 0
    for s, c in zip(values.tolist(), counts.tolist(), strict=True):
        runs.append((s, start, c))
        start += c
    return runs


def check_shapes(q, k_cache, v_cache, slot, kv_len) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [N,Hq,D] and k/v [S,T,Hkv,D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"head_dim {d} vs {k_cache.shape[3]}, Hq={hq} not a multiple of Hkv={hkv}")
    if slot.shape != (n,) or kv_len.shape != (n,):
        raise ValueError(f"slot {tuple(slot.shape)} and kv_len {tuple(kv_len.shape)} must be [{n}]")


def packed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch packed attention. `runs` and `kv_len_host` (CPU copies the planner
    already has) avoid device syncs; without them they are derived here. Tokens in no
    run (a step's padding, which the planner leaves out) get zeros."""
    check_shapes(q, k_cache, v_cache, slot, kv_len)
    if runs is None:
        runs = contiguous_runs(slot)
    if kv_len_host is None:
        kv_len_host = kv_len.cpu()
    t_max = k_cache.shape[1]
    covered = sum(n for _, _, n in runs)
    assert covered <= q.shape[0]
    out = torch.empty_like(q) if covered == q.shape[0] else torch.zeros_like(q)
    lens = kv_len_host.tolist()
    groups: dict[tuple[int, int], list[Run]] = {}
    for run in runs:
        _, start, n = run
        t = min(t_max, bucket(max(lens[start : start + n]), KEY_BLOCK))
        groups.setdefault((n, t), []).append(run)
    for (n, t), same in groups.items():
        _attend_runs(q, k_cache, v_cache, kv_len, scale, same, n, t, out)
    return out


def _attend_runs(q, k_cache, v_cache, kv_len, scale, runs, n: int, t: int, out) -> None:
    """Attention for G runs of n tokens each that read t keys: one batched GEMM pair.

    q [N, Hq, D] -> out rows of these runs; scores [G, Hkv, rows * group, t]."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    g = len(runs)
    rows = run_rows(n, group)
    dev = q.device
    if g == 1:  # views, no gathers: a prefill, or a decode of one slot
        s, start, _ = runs[0]
        idx = slice(start, start + n)
        qs, lens = q[idx].unsqueeze(0), kv_len[idx].unsqueeze(0)  # [1, n, Hq, D], [1, n]
        k, v = k_cache[s, :t].unsqueeze(0), v_cache[s, :t].unsqueeze(0)  # [1, t, Hkv, D]
    else:
        slots = torch.tensor([s for s, _, _ in runs], device=dev)
        idx = torch.tensor([st + j for _, st, _ in runs for j in range(n)], device=dev)  # [G*n]
        qs, lens = q.index_select(0, idx).view(g, n, hq, d), kv_len[idx].view(g, n)
        k = k_cache[:, :t].index_select(0, slots)  # [G, t, Hkv, D]
        v = v_cache[:, :t].index_select(0, slots)
    qs = qs.float()
    if rows > n:  # padded rows attend to key 0 only and are dropped
        qs = torch.cat([qs, qs.new_zeros(g, rows - n, hq, d)], dim=1)
        lens = torch.cat([lens, lens.new_ones(g, rows - n)], dim=1)
    qs = qs.view(g, rows, hkv, group, d).transpose(1, 2).reshape(g, hkv, rows * group, d)
    keep = torch.arange(t, device=dev) < lens.unsqueeze(-1)  # [G, rows, t]
    keep = keep.unsqueeze(2).expand(g, rows, group, t).reshape(g, 1, rows * group, t)
    o = F.scaled_dot_product_attention(
        qs, k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=keep, scale=scale
    )  # [G, Hkv, rows*group, D]
    o = o.view(g, hkv, rows, group, d).transpose(1, 2)[:, :n].reshape(g * n, hq, d)
    if g == 1:
        out[idx] = o.to(q.dtype)
    else:
        out.index_copy_(0, idx, o.to(q.dtype))


# --- Triton kernel ----------------------------------------------------------------------
#
# Supported: q / k_cache / v_cache in fp32, bf16 or fp16 (all the same dtype), head_dim D <= 256
# (padded to a power of two >= 16 with masks), Hq % Hkv == 0 with Hq / Hkv <= 32, any strides
# with a contiguous last dim, slots in any order. Preconditions not checked (a check would
# sync the device and break graph capture): 1 <= kv_len[i] <= T and 0 <= slot[i] < S.
#
# One program per (token, kv head): the Hq / Hkv query heads sharing that kv head form one
# [GROUP_PAD, BLOCK_D] tile, so each K/V row is loaded once for the whole group (MQA / GQA),
# and an online softmax (flash-attention) walks the token's slot rows in BLOCK_N steps.
# Decode (one token per slot) reads every K/V row exactly once. A long prefill re-reads its
# slot once per token (served from L2); a query-block-per-run variant would remove that.
# Compiled offline for sm_90 (triton 3.9 ptxas, 16-divisible strides): bf16, Hq/Hkv = 8,
# D = 256 uses 174 registers, no spills, 76 KiB shared memory, cp.async-pipelined K/V.
# bf16 group 32 at D = 256 uses 255 registers without spills; fp32 spills above group 16.

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # pi0.5 (Gemma 2B) head_dim
MAX_GROUP = 32  # query heads per kv head; bounds the [GROUP_PAD, BLOCK_D] fp32 accumulator
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on NVIDIA GPUs

if triton is not None:

    @triton.jit
    def _dot(a, b, acc, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        # The interpreter multiplies bf16 tiles as raw uint16 (triton 3.9), so it upcasts first.
        # 16-bit products are exact in fp32, so this matches the tensor-core result up to
        # summation order.
        if DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        return acc

    @triton.jit
    def _packed_attention_fwd(
        q_ptr,  # [N, Hq, D] queries
        k_ptr,  # [S, T, Hkv, D] keys of one layer of the arena
        v_ptr,  # [S, T, Hkv, D] values, same layout as keys
        slot_ptr,  # [N] int slot of each token
        kv_len_ptr,  # [N] int number of rows of its slot each token reads
        out_ptr,  # [N, Hq, D] output, q's dtype
        qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
        stride_qn,  # q stride over tokens (elements)
        stride_qh,  # q stride over heads
        stride_ks,  # k stride over slots
        stride_kt,  # k stride over rows
        stride_kh,  # k stride over kv heads
        stride_vs,  # v stride over slots
        stride_vt,  # v stride over rows
        stride_vh,  # v stride over kv heads
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        GROUP: tl.constexpr,  # Hq // Hkv
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= MIN_DOT
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= MIN_DOT
        BLOCK_N: tl.constexpr,  # keys per step of the online softmax
        SPLIT_P: tl.constexpr,  # 16-bit inputs: P @ V as hi + lo halves, see below
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see _dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        tok = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1).to(tl.int64)
        s = tl.load(slot_ptr + tok).to(tl.int64)
        n_keys = tl.load(kv_len_ptr + tok).to(tl.int32)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g

        q_ptrs = q_ptr + tok * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
        q_mask = mask_g[:, None] & mask_d[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)  # [GROUP_PAD, BLOCK_D]
        k_base = k_ptr + s * stride_ks + kv_head * stride_kh
        v_base = v_ptr + s * stride_vs + kv_head * stride_vh

        # Padded group rows see q = 0, hence finite scores and l_i > 0: no NaN to mask out.
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            rows = start + offs_n
            mask_n = rows < n_keys  # every block holds >= 1 valid row, so m_new stays finite
            # Masked loads also keep garbage (even NaN) past kv_len out of both products.
            k = tl.load(
                k_base + rows[None, :] * stride_kt + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            zeros = tl.zeros([GROUP_PAD, BLOCK_N], dtype=tl.float32)
            scores = _dot(q, k, zeros, DOT_IN_FP32, INPUT_PRECISION) * qk_scale
            scores = tl.where(mask_n[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])  # [GROUP_PAD, BLOCK_N] fp32
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(
                v_base + rows[:, None] * stride_vt + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if SPLIT_P:
                # The reference keeps P in fp32. Rounding P to bf16 once cost, before the output
                # rounding, 1.3x the reference's whole bf16 error (D = 256, interpreter);
                # hi + lo carries ~16 bits for one extra MMA, free in this memory-bound loop.
                p_hi = p.to(v.dtype)
                p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
                acc = _dot(p_hi, v, acc, DOT_IN_FP32, INPUT_PRECISION)
                acc = _dot(p_lo, v, acc, DOT_IN_FP32, INPUT_PRECISION)
            else:
                acc = _dot(p.to(v.dtype), v, acc, DOT_IN_FP32, INPUT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        o_ptrs = out_ptr + tok * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)

    # Decorated under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests).
    KERNEL_INTERPRETED = not isinstance(_packed_attention_fwd, triton.runtime.JITFunction)
else:
    KERNEL_INTERPRETED = False


def _pow2(n: int) -> int:
    return max(MIN_DOT, 1 << (n - 1).bit_length())


def packed_attention_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton packed attention; same contract as `packed_attention_ref`. Returns [N, Hq, D]."""
    if triton is None:
        raise RuntimeError("packed_attention_kernel needs triton, which is not installed")
    check_shapes(q, k_cache, v_cache, slot, kv_len)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slot.dtype.is_floating_point or kv_len.dtype.is_floating_point:
        raise ValueError(f"slot and kv_len must be integer, got {slot.dtype}, {kv_len.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, slot, kv_len)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    if not (q.is_cuda or KERNEL_INTERPRETED):
        raise RuntimeError(
            f"packed_attention_kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1 set "
            f"before this module is imported), got {q.device}"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"dtype {q.dtype} unsupported, expected one of {KERNEL_DTYPES}")
    n_tok, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    if d > MAX_HEAD_DIM or group > MAX_GROUP:
        raise RuntimeError(f"head_dim {d} > {MAX_HEAD_DIM} or Hq/Hkv {group} > {MAX_GROUP}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise RuntimeError(
            f"last dim must be contiguous, strides {q.stride()}, {k_cache.stride()}, "
            f"{v_cache.stride()}"
        )
    fp32 = q.dtype == torch.float32
    # The interpreter truncates fp32 -> 16-bit casts (triton 3.9) where GPUs round to nearest
    # even, so under it the kernel writes fp32 and torch rounds.
    out_dtype = torch.float32 if KERNEL_INTERPRETED else q.dtype
    out = torch.empty((n_tok, hq, d), dtype=out_dtype, device=q.device)
    if n_tok == 0:
        return out.to(q.dtype)
    # fp32 (ieee dots on CUDA cores) spills at BLOCK_N = 64, D = 256; 32 does not (ptxas, sm_90).
    block_n = 32 if fp32 else 64
    _packed_attention_fwd[(n_tok, hkv)](
        q,
        k_cache,
        v_cache,
        slot,
        kv_len,
        out,
        scale * 1.4426950408889634,  # log2(e)
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=_pow2(group),
        HEAD_DIM=d,
        BLOCK_D=_pow2(d),
        BLOCK_N=block_n,
        SPLIT_P=not fp32,
        DOT_IN_FP32=KERNEL_INTERPRETED,
        INPUT_PRECISION="ieee" if fp32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out.to(q.dtype)


def packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if q.is_cuda:
        return packed_attention_kernel(q, k_cache, v_cache, slot, kv_len, scale)
    return packed_attention_ref(q, k_cache, v_cache, slot, kv_len, scale, runs, kv_len_host)
