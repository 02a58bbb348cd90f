"""pi0.5's adaptive RMSNorm folded into the gate/up GEMM, the GELU gate in the epilogue.

    norm_gate_up   xn = rms_norm(h) * (1 + scale) + shift;  gelu_tanh(xn W_gate^T) * (xn W_up^T)

The shared prologue (the rows' RMS, each h tile normalised and modulated in registers) is
kernels/norm_prologue.py; here the epilogue holds the same columns of gate and up in two fp32
accumulators and gates them before the one rounding to h's dtype.

Supported range: as kernels/norm_prologue.py for h, scale1, shift and the weight (gate rows,
then up rows). Output in h's dtype: the gated MLP activation contiguous [N, F].

The reference `norm_gate_up_ref` is the model's CPU chain (AdaRMSNorm.modulate, one GEMM per
projection as `GatedMLP` runs without model/fused.py, gelu_gate): the CPU runs it, so CPU
bytes are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.gelu_gate import gelu_gate_ref
from embodied_kv.kernels.norm_prologue import (
    PI05_EXPERT,
    check_common,
    numerics,
    pick_block_k,
    pick_block_m,
    tag,
)
from embodied_kv.kernels.rms_norm import rms_norm_ref
from embodied_kv.kernels.triton_base import Launch, pow2, tl, triton, use_kernel

GATE_BLOCK_N = 32  # gate (and up) columns per program: pi05 F = 4096 -> 128 programs
# K per step, timed on an H200 (bench/kernel_sweep.py, 2026-12-04, pi05 bf16, 18 layers from
# HBM): 128 -> 20.7 us a call, against 27.6 at 64 (before) and 21.2 at 256; 32 columns beat
# 16 and 64 at every K, 4 warps beat 8. fp32 keeps BLOCK_K (pick_block_k).
GATE_BLOCK_K = 128


def norm_gate_up_ref(
    h: torch.Tensor,  # [N, W]
    scale1: torch.Tensor,  # [W] fp32
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_gate_up: torch.Tensor,  # [2F, W]: gate rows, then up rows
    hidden: int,  # F
) -> torch.Tensor:
    """-> gelu_tanh(xn W_gate^T) * (xn W_up^T) [N, F], h's dtype."""
    xn = rms_norm_ref(h, scale1, eps, shift)
    w_gate, w_up = w_gate_up.split(hidden)
    return gelu_gate_ref(F.linear(xn, w_gate), F.linear(xn, w_up))


if triton is not None:
    from embodied_kv.kernels.norm_prologue import norm_dot_pair
    from embodied_kv.kernels.triton_base import round_bf16

    def norm_gate_up_tile_fn(
        pid_m,  # row block
        pid_c,  # column block of gate (and up)
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [2F, W] fused gate/up weight, h's dtype
        out_ptr,  # [N, F] contiguous output
        n_rows,  # N
        width,  # W
        hidden,  # F
        eps,
        stride_h,  # h stride over rows (elements)
        stride_w,  # weight stride over rows
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # gate (and up) columns per program
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        # grid (cdiv(N, BLOCK_M), cdiv(F, BLOCK_N)): program (m, c) owns rows [m*BLOCK_M, ...)
        # and features [c*BLOCK_N, ...): gate rows cols of the weight and up rows F + cols
        cols = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < hidden
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < n_rows
        g, acc_u = norm_dot_pair(
            h_ptr, scale_ptr, shift_ptr, w_ptr, rows, mask_m, cols, cols + hidden, mask_n,
            width, eps, stride_h, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, ROUND_BF16, DOT_IN_FP32,
            INPUT_PRECISION,
        )  # fmt: skip
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi): torch's tanh GELU
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        y = round_bf16(0.5 * g * (1.0 + tanh) * acc_u, ROUND_BF16)
        mask = mask_m[:, None] & mask_n[None, :]
        out = out_ptr + rows[:, None] * hidden + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)

    # the kernel's body: inlined in its kernel, a call in a persistent kernel's loop
    norm_gate_up_tile = triton.jit(norm_gate_up_tile_fn)
    norm_gate_up_tile_call = triton.jit(noinline=True)(norm_gate_up_tile_fn)

    @triton.jit
    def _norm_gate_up_fwd(
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [2F, W] fused gate/up weight, h's dtype
        out_ptr,  # [N, F] contiguous output
        n_rows,  # N
        width,  # W
        hidden,  # F
        eps,
        stride_h,  # h stride over rows (elements)
        stride_w,  # weight stride over rows
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # gate (and up) columns per program
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        norm_gate_up_tile(
            tl.program_id(0), tl.program_id(1), h_ptr, scale_ptr, shift_ptr, w_ptr,
            out_ptr, n_rows, width, hidden, eps, stride_h, stride_w, BLOCK_M, BLOCK_N,
            BLOCK_K, ROUND_BF16, DOT_IN_FP32, INPUT_PRECISION,
        )  # fmt: skip


def plan_norm_gate_up(
    h: torch.Tensor,  # [N, W]
    scale1: torch.Tensor,  # [W] fp32
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_gate_up: torch.Tensor,  # [2F, W]
    out: torch.Tensor,  # [N, F] contiguous
) -> Launch:
    """The one launch (inputs already validated): grid (cdiv(N, BLOCK_M), cdiv(F,
    BLOCK_N)); at pi05 one row block of 64 x 128 column programs."""
    n, w = h.shape
    hidden = out.shape[1]
    block_m = pick_block_m(n)
    block_n = min(GATE_BLOCK_N, pow2(hidden))
    block_k = pick_block_k(h.dtype, GATE_BLOCK_K, w)
    strides = (h.stride(0), w_gate_up.stride(0))
    return Launch(
        name=f"norm_gate_up {tag(h)} F={hidden} block_m={block_m} block_n={block_n} "
        f"block_k={block_k}",
        kernel=_norm_gate_up_fwd,
        grid=(-(-n // block_m), -(-hidden // block_n)),
        args=(h, scale1, shift, w_gate_up, out, n, w, hidden, eps, *strides),
        constexprs={
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            **numerics(h.dtype),
        },
        num_warps=4,
        num_stages=3,
    )


def norm_gate_up_kernel(h, scale1, shift, eps: float, w_gate_up, hidden: int) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); arguments as
    `norm_gate_up_ref`."""
    if hidden <= 0:
        raise ValueError(f"norm_gate_up: hidden must be positive, got {hidden}")
    check_common(h, scale1, shift, w_gate_up, 2 * hidden, "norm_gate_up")
    out = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=h.device)
    plan_norm_gate_up(h, scale1, shift, eps, w_gate_up, out).run()
    return out


def norm_gate_up(h, scale1, shift, eps: float, w_gate_up, hidden: int) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(h, scale1, shift, w_gate_up):
        out = try_kernel("norm_gate_up", norm_gate_up_kernel, h, scale1, shift, eps, w_gate_up,
                         hidden)  # fmt: skip
        if out is not None:
            return out
    return norm_gate_up_ref(h, scale1, shift, eps, w_gate_up, hidden)


def pi05_launches(dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The one launch at pi05 expert shapes, planned on `meta` tensors (for
    kernels/offline_compile.py)."""
    n, w, hidden = (PI05_EXPERT[k] for k in ("rows", "width", "mlp"))
    meta = {"dtype": dtype, "device": "meta"}
    h = torch.empty(n, w, **meta)
    vec = torch.empty(w, device="meta")
    gate_up = plan_norm_gate_up(
        h, vec, vec, 1e-6, torch.empty(2 * hidden, w, **meta), torch.empty(n, hidden, **meta)
    )
    return [gate_up]
