"""RMSNorm with its affine step in one kernel: Gemma's plain norm and pi0.5's adaptive one.

    plain     y = x / rms(x) * (1 + weight)            (Gemma: the weight is stored as w - 1)
    adaptive  y = x / rms(x) * (1 + scale) + shift     (pi0.5 adaRMS; 1 + scale precomputed)

In torch these are 8-10 kernels per call (casts, pow, mean, add, rsqrt, products) and each
reads or writes the [N, W] activation: at pi05 a 576-row prefill moves ~3.8 GB through
them over 18 layers, and the expert's 10 Euler steps launch ~16 of them per layer and step.
Here one program normalises one row in fp32 registers: the row is read once, written once.

Supported range: x fp32, bf16 or fp16 with a contiguous last dim, W <= 16384 (one row per
program, padded to a power of two with masks); `mult` / `shift` fp32 [W]; output in x's dtype.
The reference `rms_norm_ref` is the model's torch code: on the CPU the model runs it, so CPU
results are bytes-identical to the unfused code they replace.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    Launch,
    as_dtype,
    pow2,
    tl,
    triton,
    use_kernel,
)

MAX_WIDTH = 16_384


def rms_norm_ref(
    x: torch.Tensor,
    mult: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
    add_one: bool = False,
) -> torch.Tensor:
    """x [..., W] -> x / rms(x) * (add_one + mult) (+ shift), computed in fp32, x's dtype."""
    xf = x.float()
    # x * rsqrt(mean(x^2) + eps) in fp32: torch composes rms_norm of exactly these ops (same
    # bytes), in one call from Python instead of five (a tiny decode step runs nine norms)
    normed = torch.rms_norm(xf, (xf.shape[-1],), eps=eps)
    m = 1.0 + mult.float() if add_one else mult
    if shift is None:
        return as_dtype(normed * m, x.dtype)
    return as_dtype(torch.addcmul(shift, normed, m), x.dtype)


if triton is not None:
    from embodied_kv.kernels.triton_base import round_bf16

    @triton.jit
    def normed_row(x, width, eps, mult_ptr, shift_ptr, offs, mask, ADD_ONE: tl.constexpr,
                   HAS_SHIFT: tl.constexpr, ROUND_BF16: tl.constexpr):  # fmt: skip
        """One fp32 row x [BLOCK_W] -> x / rms(x) * (ADD_ONE + mult) (+ shift), rounded as
        stored: the one RMSNorm arithmetic of this kernel and kernels/gated_rms_norm.py's."""
        ms = tl.sum(x * x, axis=0) / width
        y = x * (1.0 / tl.sqrt(ms + eps))
        m = tl.load(mult_ptr + offs, mask=mask, other=0.0)
        if ADD_ONE:
            m = m + 1.0
        y = y * m
        if HAS_SHIFT:
            y = y + tl.load(shift_ptr + offs, mask=mask, other=0.0)
        return round_bf16(y, ROUND_BF16)

    @triton.jit
    def _rms_norm_fwd(
        x_ptr,  # [N, W] input rows, any row stride, contiguous last dim
        mult_ptr,  # [W] fp32 multiplier (1 + scale), or the raw weight when ADD_ONE
        shift_ptr,  # [W] fp32 shift (read only when HAS_SHIFT)
        out_ptr,  # [N, W] output rows, x's dtype
        width,  # W
        eps,  # added to the mean square
        stride_x,  # x stride over rows (elements)
        stride_o,  # out stride over rows
        BLOCK_W: tl.constexpr,  # W rounded up to a power of two
        ADD_ONE: tl.constexpr,  # multiply by 1 + mult (Gemma's stored weight)
        HAS_SHIFT: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_W)
        mask = offs < width
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = normed_row(x, width, eps, mult_ptr, shift_ptr, offs, mask, ADD_ONE, HAS_SHIFT,
                       ROUND_BF16)  # fmt: skip
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def plan_rms_norm(
    x: torch.Tensor,  # [N, W]
    mult: torch.Tensor,  # [W] fp32
    eps: float,
    out: torch.Tensor,  # [N, W]
    shift: torch.Tensor | None = None,  # [W] fp32
    add_one: bool = False,
) -> Launch:
    """The one launch of a fused RMSNorm: grid (N,), one row per program; 8 warps hold a
    2048-wide fp32 row in 8 registers per thread."""
    n, w = x.shape
    block = pow2(w)
    return Launch(
        name=f"rms_norm {str(x.dtype).removeprefix('torch.')} W={w} shift={shift is not None}",
        kernel=_rms_norm_fwd,
        grid=(n,),
        args=(x, mult, mult if shift is None else shift, out, w, eps, x.stride(0), out.stride(0)),
        constexprs={
            "BLOCK_W": block,
            "ADD_ONE": add_one,
            "HAS_SHIFT": shift is not None,
            "ROUND_BF16": INTERPRETED and out.dtype == torch.bfloat16,
        },
        num_warps=8 if block >= 2048 else 4,
        num_stages=1,
    )


def rms_norm_kernel(
    x: torch.Tensor,
    mult: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
    add_one: bool = False,
) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): x [..., W]."""
    if triton is None:
        raise RuntimeError("the fused RMSNorm needs triton, which is not installed")
    w = x.shape[-1]
    if w > MAX_WIDTH or x.stride(-1) != 1:
        raise RuntimeError(f"rms_norm kernel: width {w} > {MAX_WIDTH} or last dim not contiguous")
    for name, t in (("mult", mult), ("shift", shift)):
        if t is not None and (t.shape != (w,) or t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(
                f"{name} must be a contiguous fp32 [{w}], got {t.dtype} {tuple(t.shape)}"
            )
    rows = x.reshape(-1, w)
    out = torch.empty_like(rows)
    plan_rms_norm(rows, mult, eps, out, shift, add_one).run()
    return out.view(x.shape)


def rms_norm(
    x: torch.Tensor,
    mult: torch.Tensor,
    eps: float,
    shift: torch.Tensor | None = None,
    add_one: bool = False,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    w = x.shape[-1]  # the kernel takes one [W] scale (and shift) for all rows
    per_row = mult.shape != (w,) or (shift is not None and shift.shape != (w,))
    if use_kernel(x, mult, shift) and not per_row:
        out = try_kernel("rms_norm", rms_norm_kernel, x, mult, eps, shift, add_one)
        if out is not None:
            return out
    return rms_norm_ref(x, mult, eps, shift, add_one)
