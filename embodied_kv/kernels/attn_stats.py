"""Attention statistics of a few query rows over a slot's keys (VL-Cache, post-vision scoring).

For τ query rows (the prompt text after the image tokens) against m key rows of one layer,
per query head:

    col_sum  [Hq, m]  fp32   Σ_rows softmax(q k^T * scale)          (the token scores)
    below    [Hq]     int64  #{(row, col): p_rc < threshold * max_c p_rc}   (the sparsity count)

without materialising the [τ, m] probability matrix: two passes over the keys per program,
the first for each row's max and softmax denominator, the second for the normalised column
sums and the count (p_rc < t * rowmax  <=>  exp(s_rc - max_r) < t, no division needed).

Grid (cdiv(τ, BLOCK_M), Hq): program (b, h) takes query rows [b*BLOCK_M, (b+1)*BLOCK_M) of
head h and reads KV head h // GROUP (GQA / MQA: the query heads of a group share K rows). Each
program writes its partial column sums [m] and count to its own row of a workspace, summed in
torch afterwards: deterministic (an atomic_add would sum in arrival order and could flip ties
of the top-k that reads these scores). τ is a prompt's text (~20-200 rows), so the workspace
has a handful of rows; re-reading K per query head costs, at pi05 (group 8, m ~ 900, D 256,
bf16), ~3.7 MB per layer, about 1 µs of H100 bandwidth.

Supported range: q / k fp32, bf16 or fp16 (one dtype), head_dim <= 256, Hq / Hkv <= 32, any
row and head strides with a contiguous last dim, m >= 1, τ >= 1.
"""

from __future__ import annotations

import math

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    KERNEL_DTYPES,
    LOG2E,
    MAX_GROUP,
    MAX_HEAD_DIM,
    Launch,
    pow2,
    precision_flags,
    tl,
    triton,
    use_kernel,
)

BLOCK_M = 16  # query rows per program (tl.dot's minimum tile side)


def check_stats_inputs(q: torch.Tensor, k: torch.Tensor, threshold: float) -> None:
    """ValueError for inputs that do not fit the contract."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"expected q [τ, Hq, D] and k [m, Hkv, D], got {q.shape}, {k.shape}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"head_dim {q.shape[2]} vs {k.shape[2]}, Hq={q.shape[1]} not a "
                         f"multiple of Hkv={k.shape[1]}")  # fmt: skip
    if q.shape[0] < 1 or k.shape[0] < 1:
        raise ValueError(f"need >= 1 query row and key row, got τ={q.shape[0]}, m={k.shape[0]}")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold={threshold} must be in (0, 1) (VL-Cache p = 0.01)")


def attn_stats_ref(
    q: torch.Tensor, k: torch.Tensor, scale: float, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [τ, Hq, D], k [m, Hkv, D] -> (col_sum [Hq, m] fp32, below [Hq] int64), in fp32."""
    check_stats_inputs(q, k, threshold)
    col, below = attn_stats_ref_layers(q[None], k[None], scale, threshold)
    return col[0], below[0]


def attn_stats_ref_layers(
    q: torch.Tensor, k: torch.Tensor, scale: float, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_stats_ref` of B independent (q, k) pairs (a prefill's layers) in one pass:
    q [B, τ, Hq, D], k [B, m, Hkv, D] -> (col_sum [B, Hq, m] fp32, below [B, Hq] int64)."""
    b, rows, hq, d = q.shape
    m, hkv = k.shape[1], k.shape[2]
    # the query heads of a KV head as one [g * τ, D] GEMM against that head's keys
    qg = q.float().reshape(b, rows, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)
    kt = k.float().permute(0, 2, 3, 1).reshape(b * hkv, d, m)
    s = torch.bmm(qg.reshape(b * hkv, -1, d), kt).view(b, hq, rows, m) * scale  # [B, Hq, τ, m]
    rel = torch.exp(s - s.amax(-1, keepdim=True))  # p / rowmax
    inv = 1.0 / rel.sum(-1, keepdim=True)
    return (rel * inv).sum(2), (rel < threshold).sum((2, 3))


def kv_head_sums(colsum: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Column sums per query head [..., Hq, m] -> per KV head [..., Hkv, m]: the sums of the
    query heads h with h // GROUP == the KV head (the heads that read its keys)."""
    *lead, hq, m = colsum.shape
    return colsum.reshape(*lead, kv_heads, hq // kv_heads, m).sum(-2)


if triton is not None:
    from embodied_kv.kernels.triton_base import dot

    @triton.jit
    def _attn_stats_fwd(
        q_ptr,  # [τ, Hq, D] query rows
        k_ptr,  # [m, Hkv, D] key rows of one slot and layer, in place
        colsum_ptr,  # [n_blocks, Hq, m] fp32 out: this program's column sums
        below_ptr,  # [n_blocks, Hq] int32 out: this program's count of small entries
        n_rows,  # τ
        n_keys,  # m
        n_heads,  # Hq
        qk_scale,  # softmax scale * log2(e)
        log2_threshold,  # log2(threshold): exp2(s - max) < threshold, in the exp2 domain
        stride_qn,  # q stride over rows (elements)
        stride_qh,  # q stride over heads
        stride_kt,  # k stride over rows
        stride_kh,  # k stride over kv heads
        GROUP: tl.constexpr,  # Hq // Hkv
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= 16
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_P: tl.constexpr,  # unused here (the shared precision flags)
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        blk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        kv_head = head // GROUP
        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = offs_m < n_rows
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + offs_m[:, None].to(tl.int64) * stride_qn + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]; padded rows are q = 0 (finite scores), masked below
        k_base = k_ptr + kv_head * stride_kh

        # pass 1: row max (exp2 domain) and softmax denominator, online
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            cols = start + offs_n
            kt = tl.load(
                k_base + cols[None, :].to(tl.int64) * stride_kt + offs_d[:, None],
                mask=(cols < n_keys)[None, :] & mask_d[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            s = dot(q, kt, zeros, DOT_IN_FP32, INPUT_PRECISION) * qk_scale
            s = tl.where((cols < n_keys)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new

        # pass 2: normalised probabilities, summed over this block's rows per column
        inv_l = 1.0 / l_i
        count = tl.zeros([BLOCK_M], dtype=tl.int32)
        out_row = (blk * n_heads + head) * n_keys
        for start in range(0, n_keys, BLOCK_N):
            cols = start + offs_n
            mask_n = cols < n_keys
            kt = tl.load(
                k_base + cols[None, :].to(tl.int64) * stride_kt + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            s = dot(q, kt, zeros, DOT_IN_FP32, INPUT_PRECISION) * qk_scale
            rel = s - m_i[:, None]  # log2(p / rowmax) <= 0
            valid = mask_m[:, None] & mask_n[None, :]
            p = tl.where(valid, tl.exp2(rel) * inv_l[:, None], 0.0)
            tl.store(colsum_ptr + out_row + cols, tl.sum(p, 0), mask=mask_n)
            count += tl.sum((valid & (rel < log2_threshold)).to(tl.int32), 1)
        tl.store(below_ptr + blk * n_heads + head, tl.sum(count, 0))


def stats_config(dtype: torch.dtype) -> int:
    """Keys per step (BLOCK_N): fp32 (ieee dots on CUDA cores) takes half the 16-bit tile."""
    return 32 if dtype == torch.float32 else 64


def plan_attn_stats(
    q: torch.Tensor,  # [τ, Hq, D]
    k: torch.Tensor,  # [m, Hkv, D]
    scale: float,
    threshold: float,
    colsum: torch.Tensor,  # [n_blocks, Hq, m] fp32 workspace
    below: torch.Tensor,  # [n_blocks, Hq] int32 workspace
) -> Launch:
    """The one launch of `attn_stats_kernel` (shapes only: plans on `meta` tensors too)."""
    if triton is None:
        raise RuntimeError("attn_stats_kernel needs triton, which is not installed")
    check_stats_inputs(q, k, threshold)
    if q.dtype != k.dtype or q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q and k must share one of {KERNEL_DTYPES}, got {q.dtype}, {k.dtype}")
    rows, hq, d = q.shape
    group = hq // k.shape[1]
    if d > MAX_HEAD_DIM or group > MAX_GROUP:
        raise RuntimeError(f"head_dim {d} > {MAX_HEAD_DIM} or Hq/Hkv {group} > {MAX_GROUP}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise RuntimeError(f"last dim must be contiguous, strides {q.stride()}, {k.stride()}")
    blocks = -(-rows // BLOCK_M)
    if colsum.shape != (blocks, hq, k.shape[0]) or below.shape != (blocks, hq):
        raise ValueError(f"workspace {tuple(colsum.shape)} / {tuple(below.shape)} does not fit "
                         f"{blocks} blocks x {hq} heads x {k.shape[0]} keys")  # fmt: skip
    block_n = stats_config(q.dtype)
    return Launch(
        name=f"attn_stats {str(q.dtype).removeprefix('torch.')} D={d} group={group} "
        f"block_m={BLOCK_M} block_n={block_n}",
        kernel=_attn_stats_fwd,
        grid=(blocks, hq),
        args=(
            q, k, colsum, below, rows, k.shape[0], hq, scale * LOG2E,
            math.log2(threshold),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        ),  # fmt: skip
        constexprs={
            "GROUP": group,
            "HEAD_DIM": d,
            "BLOCK_D": pow2(d),
            "BLOCK_M": BLOCK_M,
            "BLOCK_N": block_n,
            **precision_flags(q.dtype),
        },
        num_warps=4,
        num_stages=2,
    )


def stats_workspace(rows: int, hq: int, keys: int, device, layers: int = 1, kernel=None):
    """Partials of `layers` calls: col_sum [layers, n_blocks, Hq, m] fp32, below [layers,
    n_blocks, Hq] int32 (n_blocks = cdiv(τ, BLOCK_M) for the kernel, 1 for the reference;
    `kernel` None: the kernel on CUDA). Sum over n_blocks (and heads) once after all layers:
    one reduction per prefill, not per layer."""
    if kernel is None:
        kernel = torch.device(device).type == "cuda"
    blocks = -(-rows // BLOCK_M) if kernel else 1
    return (
        torch.empty(layers, blocks, hq, keys, dtype=torch.float32, device=device),
        torch.empty(layers, blocks, hq, dtype=torch.int32, device=device),
    )


def attn_stats_into(
    q: torch.Tensor, k: torch.Tensor, scale: float, threshold: float,
    colsum: torch.Tensor, below: torch.Tensor,
) -> None:  # fmt: skip
    """Write one call's partials into a layer's workspace (`stats_workspace(...)[l]`): one
    kernel launch when the workspace has the kernel's blocks (on CUDA), else the reference
    into its one partial row."""
    if colsum.shape[0] == -(-q.shape[0] // BLOCK_M) and (q.is_cuda or INTERPRETED):
        plan_attn_stats(q, k, scale, threshold, colsum, below).run()
        return
    if colsum.shape[0] != 1:
        raise ValueError(f"workspace of {colsum.shape[0]} partial rows for τ={q.shape[0]}")
    col, n_below = attn_stats_ref(q, k, scale, threshold)
    colsum.copy_(col.unsqueeze(0))
    below.copy_(n_below.unsqueeze(0))


def attn_stats_kernel(
    q: torch.Tensor, k: torch.Tensor, scale: float, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `attn_stats_ref`: the same (col_sum [Hq, m] fp32, below [Hq] int64)."""
    if not (q.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"attn_stats_kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1 set before "
            f"triton is imported), got {q.device}"
        )
    blocks = -(-q.shape[0] // BLOCK_M)
    colsum = torch.empty(blocks, q.shape[1], k.shape[0], dtype=torch.float32, device=q.device)
    below = torch.empty(blocks, q.shape[1], dtype=torch.int32, device=q.device)
    plan_attn_stats(q, k, scale, threshold, colsum, below).run()
    return colsum.sum(0), below.sum(0, dtype=torch.int64)


def attn_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the kernel on CUDA, the reference elsewhere (the CPU path)."""
    if use_kernel(q, k):
        stats = try_kernel("attn_stats", attn_stats_kernel, q, k, scale, threshold)
        if stats is not None:
            return stats
    return attn_stats_ref(q, k, scale, threshold)
