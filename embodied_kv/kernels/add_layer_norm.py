"""Residual add and the LayerNorm after it in one kernel: SigLIP's stream between GEMMs.

    s   = x + y                  the new residual stream (x's dtype), written
    out = LayerNorm(s) * w + b   the next GEMM's input (x's dtype), written

In the vision encoder (model/vision_fast.py) every GEMM whose output joins the residual is
followed by a LayerNorm: out_proj -> layer_norm2, fc2 -> the next layer's layer_norm1 (or
the tower's post_layernorm). In torch that is two kernels, the add and the norm, and the
norm re-reads the stream the add has just written; here one program reads one row of x
and y once and writes s and out: 2 kernels per layer fewer (8 instead of 10).

The sum is rounded to x's dtype before it is normalised, as the two torch ops do (the
stream is stored in that dtype); mean and variance in fp32 (biased variance, eps inside
the square root), as torch's LayerNorm.

Supported range: x, y fp32, bf16 or fp16 of one dtype, [N, W] with a contiguous last dim
(any row strides), W <= 16384 (one row per program, padded to a power of two with masks);
weight and bias [W] contiguous, any float dtype (read as fp32). The reference
`add_layer_norm_ref` is the torch code the CPU runs (the same bytes as add, then LayerNorm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import INTERPRETED, Launch, pow2, tl, triton, use_kernel

MAX_WIDTH = 16_384


def add_layer_norm_ref(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y [..., W] -> (s = x + y, LayerNorm(s)); y may be overwritten with s."""
    s = y.add_(x) if not (torch.is_grad_enabled() and y.requires_grad) else x + y
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


if triton is not None:
    from embodied_kv.kernels.triton_base import round_bf16

    @triton.jit
    def _add_layer_norm_fwd(
        x_ptr,  # [N, W] residual stream rows, contiguous last dim
        y_ptr,  # [N, W] the GEMM output joining it, x's dtype
        w_ptr,  # [W] LayerNorm weight
        b_ptr,  # [W] LayerNorm bias
        s_ptr,  # [N, W] out: x + y, x's dtype
        out_ptr,  # [N, W] out: LayerNorm(x + y), x's dtype
        width,  # W
        eps,  # added to the variance
        stride_x,  # x stride over rows (elements)
        stride_y,  # y stride over rows
        stride_s,  # s stride over rows
        stride_o,  # out stride over rows
        BLOCK_W: tl.constexpr,  # W rounded up to a power of two
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_W)
        mask = offs < width
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_bf16(x + y, ROUND_BF16)
        s = s.to(s_ptr.dtype.element_ty)  # the stored stream is what gets normalised
        tl.store(s_ptr + row * stride_s + offs, s, mask=mask)
        s = s.to(tl.float32)
        mean = tl.sum(s, axis=0) / width
        d = tl.where(mask, s - mean, 0.0)
        var = tl.sum(d * d, axis=0) / width
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        o = round_bf16(d * (1.0 / tl.sqrt(var + eps)) * w + b, ROUND_BF16)
        tl.store(out_ptr + row * stride_o + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


def plan_add_layer_norm(
    x: torch.Tensor,  # [N, W]
    y: torch.Tensor,  # [N, W]
    weight: torch.Tensor,  # [W]
    bias: torch.Tensor,  # [W]
    eps: float,
    s: torch.Tensor,  # [N, W]
    out: torch.Tensor,  # [N, W]
) -> Launch:
    """The one launch: grid (N,), one row per program (SigLIP's 1152-wide rows: 8 warps,
    about 5 fp32 registers per thread for each of x, y)."""
    n, w = x.shape
    block = pow2(w)
    strides = (x.stride(0), y.stride(0), s.stride(0), out.stride(0))
    return Launch(
        name=f"add_layer_norm {str(x.dtype).removeprefix('torch.')} W={w}",
        kernel=_add_layer_norm_fwd,
        grid=(n,),
        args=(x, y, weight, bias, s, out, w, eps, *strides),
        constexprs={
            "BLOCK_W": block,
            "ROUND_BF16": INTERPRETED and x.dtype == torch.bfloat16,
        },
        num_warps=8 if block >= 1024 else 4,
        num_stages=1,
    )


def add_layer_norm_kernel(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): x, y [N, W]."""
    if triton is None:
        raise RuntimeError("the fused add + LayerNorm needs triton, which is not installed")
    if x.dim() != 2 or y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"x, y must be [N, W] of one dtype, got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(y.shape)} {y.dtype}")  # fmt: skip
    w = x.shape[-1]
    if w > MAX_WIDTH or x.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError(f"add_layer_norm: width {w} > {MAX_WIDTH} or last dim not contiguous")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (w,) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a contiguous [{w}], got {tuple(t.shape)}")
    s, out = torch.empty_like(x), torch.empty_like(x)
    plan_add_layer_norm(x, y, weight, bias, eps, s, out).run()
    return s, out


def add_layer_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(x, y, weight, bias) and x.dim() == 2 and x.shape[-1] <= MAX_WIDTH:
        out = try_kernel("add_layer_norm", add_layer_norm_kernel, x, y, weight, bias, eps)
        if out is not None:
            return out
    return add_layer_norm_ref(x, y, weight, bias, eps)
