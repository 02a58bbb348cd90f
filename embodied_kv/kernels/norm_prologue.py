"""The prologue pi0.5's norm-folded GEMMs share: the adaptive RMSNorm computed inside the
GEMM that reads it (kernels/norm_qkv_rope.py, kernels/norm_gate_up.py).

    xn = rms_norm(h) * (1 + scale) + shift

The action expert runs each of these chains in every layer of every Euler step on 50 rows
(pi05: 18 layers x 10 steps): norm, GEMM and RoPE (or GELU-gate) as 3-4 kernels that pass
the [50, W] / [50, F] activations through memory between them. Here one kernel does each:
a program owns a [BLOCK_M rows x BLOCK_N columns] output tile, computes its rows' RMS in a
prologue (one pass over K = W), then streams K, normalising and modulating each h tile in
registers, rounding it to h's dtype exactly where the unfused chain does (the norm's
output), and feeding it to the tensor-core dot. The epilogue sees both halves of what it
needs: for RoPE the columns d and d + D/2 of a head (two accumulators), for the gate the
same columns of gate and up (two accumulators), so the fp32 accumulators are rotated or
gated before the one rounding to h's dtype.

Supported range (both kernels): h [N, W] fp32, bf16 or fp16 with a contiguous last dim (any
row stride); scale1 (1 + scale) and shift contiguous fp32 [W]; weights [out, W] in h's dtype
with a contiguous last dim (`RowFusion.weight`: q, k, v rows / gate, up rows).
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.triton_base import INTERPRETED, KERNEL_DTYPES, pow2, tl, triton

MAX_BLOCK_M = 64  # rows per program: a Hopper warpgroup MMA's M; pi05's 50 rows in one block
BLOCK_K = 64
# pi05's action expert (model/config.py PRESETS["pi05"].expert, action_horizon): 50 action
# rows (velocity_at runs them unpadded), width 1024, 8 query heads / 1 KV head of 256, MLP 4096
PI05_EXPERT = {"rows": 50, "width": 1024, "heads": (8, 1, 256), "mlp": 4096}


if triton is not None:
    from embodied_kv.kernels.triton_base import dot, round_bf16

    @triton.jit
    def inv_rms(
        h_ptr,  # [N, W] rows
        rows,  # [BLOCK_M] row indices
        mask_m,  # [BLOCK_M] rows < N
        width,  # W
        eps,
        stride_h,  # h stride over rows
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """[BLOCK_M] fp32 1 / rms of each row (rms_norm: mean square + eps, one pass)."""
        offs_k = tl.arange(0, BLOCK_K)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            kk = k0 + offs_k
            mask = mask_m[:, None] & (kk < width)[None, :]
            x = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(sq / width + eps)

    @triton.jit
    def modulated_tile(
        h_ptr,  # [N, W] rows
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        rows,  # [BLOCK_M] row indices
        mask_m,  # [BLOCK_M] rows < N
        inv,  # [BLOCK_M] fp32 1 / rms
        kk,  # [BLOCK_K] column indices of h
        width,  # W
        stride_h,  # h stride over rows
        ROUND_BF16: tl.constexpr,
    ):
        """[BLOCK_M, BLOCK_K] of the norm's output in h's dtype: (x / rms) * scale1 + shift,
        zeros past W (rows past N hold `shift`; their outputs are never stored)."""
        mask_k = kk < width
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=mask, other=0.0)
        s = tl.load(scale_ptr + kk, mask=mask_k, other=0.0)
        b = tl.load(shift_ptr + kk, mask=mask_k, other=0.0)
        y = (x.to(tl.float32) * inv[:, None]) * s[None, :] + b[None, :]
        return round_bf16(y, ROUND_BF16).to(h_ptr.dtype.element_ty)

    @triton.jit
    def weight_tile(
        w_ptr,  # [R, W] weight rows
        cols,  # [BLOCK_N] weight rows (output columns)
        mask_n,  # [BLOCK_N] which of them exist
        kk,  # [BLOCK_K]
        width,  # W
        stride_w,  # weight stride over rows
    ):
        """[BLOCK_K, BLOCK_N] of W^T, zeros outside."""
        mask = (kk < width)[:, None] & mask_n[None, :]
        return tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=mask, other=0.0)

    @triton.jit
    def norm_dot_pair(
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [out, W] weight, h's dtype
        rows,  # [BLOCK_M] row indices
        mask_m,  # rows < N
        cols_a,  # [BLOCK_N] weight rows of the first accumulator
        cols_b,  # [BLOCK_N] weight rows of the second (RoPE's other half, or up beside gate)
        mask_c,  # [BLOCK_N] valid columns
        width,  # W = K
        eps,
        stride_h,
        stride_w,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # The prologue (the rows' RMS), then K streamed once: each h tile normalised and
        # modulated in registers, dotted with both weight tiles -> two fp32 [M, N] accumulators
        inv = inv_rms(h_ptr, rows, mask_m, width, eps, stride_h, BLOCK_M, BLOCK_K)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, width, BLOCK_K):
            kk = k0 + offs_k
            x = modulated_tile(
                h_ptr, scale_ptr, shift_ptr, rows, mask_m, inv, kk, width, stride_h, ROUND_BF16
            )
            acc_a = dot(x, weight_tile(w_ptr, cols_a, mask_c, kk, width, stride_w), acc_a,
                        DOT_IN_FP32, INPUT_PRECISION)  # fmt: skip
            acc_b = dot(x, weight_tile(w_ptr, cols_b, mask_c, kk, width, stride_w), acc_b,
                        DOT_IN_FP32, INPUT_PRECISION)  # fmt: skip
        return acc_a, acc_b


def numerics(dtype: torch.dtype) -> dict[str, object]:
    return {
        "ROUND_BF16": INTERPRETED and dtype == torch.bfloat16,
        "DOT_IN_FP32": INTERPRETED,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def pick_block_k(dtype: torch.dtype, tuned: int, width: int) -> int:
    """K columns per step: `tuned` (the kernel's, timed on an H200 for 16-bit dtypes) or
    BLOCK_K for fp32 (ieee dots: twice the shared memory per tile), at most W rounded up."""
    return min(BLOCK_K if dtype == torch.float32 else tuned, max(BLOCK_K, pow2(width)))


def pick_block_m(n: int) -> int:
    return min(MAX_BLOCK_M, pow2(n))


def tag(h: torch.Tensor) -> str:
    return f"{str(h.dtype).removeprefix('torch.')} N={h.shape[0]} W={h.shape[1]}"


def check_common(h, scale1, shift, weight, rows: int, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"the fused {what} kernel needs triton, which is not installed")
    if h.dim() != 2 or h.dtype not in KERNEL_DTYPES or h.stride(-1) != 1:
        raise ValueError(
            f"{what}: h must be [N, W] fp32 / bf16 / fp16 with a contiguous last dim, got "
            f"{h.dtype} {tuple(h.shape)} strides {h.stride()}"
        )
    w = h.shape[1]
    for name, t in (("scale1", scale1), ("shift", shift)):
        if t.shape != (w,) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{what}: {name} must be a contiguous fp32 [{w}], got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    if weight.shape != (rows, w) or weight.dtype != h.dtype or weight.stride(-1) != 1:
        raise ValueError(
            f"{what}: weight must be {h.dtype} [{rows}, {w}] with a contiguous last dim, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
