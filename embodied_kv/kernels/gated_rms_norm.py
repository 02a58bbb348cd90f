"""The gated residual and the adaptive RMSNorm after it in one kernel: the action expert's
stream between its attention and its MLP.

    s   = h + gate * y                     the new residual stream (h's dtype), written
    out = s / rms(s) * scale1 + shift      the gate/up GEMM's input (h's dtype), written

In the expert's layer-step as CUDA runs it by default (the chain, model/expert_step.py
`layer_step_ref`) the o_proj GEMM's output joins the stream through `torch.addcmul` and the
post-attention adaRMS norm re-reads what it has just written: two kernels, 180 pairs an
action at pi05 (18 layers x 10 Euler steps). Here one program reads one row of h and y
once and writes s and out.

The sum is rounded to h's dtype before it is normalised, as the two torch ops do (the stream
is stored in that dtype); the product gate * y and the add in fp32 (torch's addcmul
computes in its op math, fp32 for 16-bit inputs, and rounds once), the mean square in fp32.

The backbone's residual add and the plain Gemma RMSNorm after it are the same kernel
without a gate and a shift, with 1 + weight (`add_rms_norm`: s = h + y, out = s / rms(s) *
(1 + weight)): after the o-projection (then the post-attention norm) and after the MLP (then
the next layer's input norm or the final one), 36 launches fewer a pi05 prefill.

Supported range: h, y, gate of one dtype (fp32, bf16 or fp16); h and y [N, W] with a
contiguous last dim (any row strides), gate [W] contiguous; scale1 (1 + scale) and shift
fp32 [W] (the plain norm: its fp32 weight); W <= 16384 (one row per program). The references
`gated_rms_norm_ref` and `add_rms_norm_ref` are the torch code the CPU runs: the same bytes
as addcmul (or the add), then rms_norm.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.rms_norm import MAX_WIDTH, rms_norm, rms_norm_ref
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    KERNEL_DTYPES,
    Launch,
    pow2,
    tl,
    triton,
    use_kernel,
)


def gated_rms_norm_ref(
    h: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    scale1: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, y [N, W], gate [W] -> (s = addcmul(h, y, gate), rms_norm(s) * scale1 + shift)."""
    s = torch.addcmul(h, y, gate)
    return s, rms_norm_ref(s, scale1, eps, shift)


def add_rms_norm_ref(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, y [N, W], weight [W] -> (s = h + y, rms_norm(s) * (1 + weight)): the backbone's two
    ops, the norm dispatched (kernels/rms_norm.py: its reference on a CPU)."""
    s = h + y
    return s, rms_norm(s, weight, eps, add_one=True)


if triton is not None:
    from embodied_kv.kernels.rms_norm import normed_row
    from embodied_kv.kernels.triton_base import round_bf16

    @triton.jit
    def _gated_rms_norm_fwd(
        h_ptr,  # [N, W] residual stream rows, contiguous last dim
        y_ptr,  # [N, W] the GEMM output joining it, h's dtype
        gate_ptr,  # [W] gate, h's dtype (HAS_GATE)
        scale_ptr,  # [W] fp32 1 + scale (ADD_ONE: the weight w of 1 + w)
        shift_ptr,  # [W] fp32 shift (HAS_SHIFT)
        s_ptr,  # [N, W] out: h + gate * y, h's dtype
        out_ptr,  # [N, W] out: the normed, modulated s, h's dtype
        width,  # W
        eps,  # added to the mean square
        stride_h,  # h stride over rows (elements)
        stride_y,  # y stride over rows
        stride_s,  # s stride over rows
        stride_o,  # out stride over rows
        BLOCK_W: tl.constexpr,  # W rounded up to a power of two
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        HAS_GATE: tl.constexpr,  # s = h + gate * y, else h + y
        ADD_ONE: tl.constexpr,  # multiply by 1 + scale (Gemma's stored weight)
        HAS_SHIFT: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_W)
        mask = offs < width
        h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            y = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y
        s = round_bf16(h + y, ROUND_BF16).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + offs, s, mask=mask)
        x = s.to(tl.float32)  # the stored stream, as the norm after addcmul reads it
        out = normed_row(x, width, eps, scale_ptr, shift_ptr, offs, mask, ADD_ONE, HAS_SHIFT,
                         ROUND_BF16)  # fmt: skip
        tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def plan_gated_rms_norm(h, y, gate, scale1, shift, eps: float, s, out) -> Launch:
    """The one launch: grid (N,), one row per program (inputs already validated). `gate` and
    `shift` None with scale1 the plain norm's weight: `add_rms_norm`'s launch."""
    n, w = h.shape
    block = pow2(w)
    plain = gate is None
    return Launch(
        name=f"{'add' if plain else 'gated'}_rms_norm {str(h.dtype).removeprefix('torch.')} W={w}",
        kernel=_gated_rms_norm_fwd,
        grid=(n,),
        args=(h, y, h if plain else gate, scale1, scale1 if plain else shift, s, out, w, eps,
              h.stride(0), y.stride(0), s.stride(0), out.stride(0)),  # fmt: skip
        constexprs={
            "BLOCK_W": block,
            "ROUND_BF16": INTERPRETED and h.dtype == torch.bfloat16,
            "HAS_GATE": not plain,
            "ADD_ONE": plain,
            "HAS_SHIFT": shift is not None,
        },
        num_warps=8 if block >= 2048 else 4,
        num_stages=1,
    )


def gated_rms_norm_kernel(h, y, gate, scale1, shift, eps: float):
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1) -> (s, out). `gate`
    and `shift` None: the plain norm with 1 + scale1 (`add_rms_norm`)."""
    if triton is None:
        raise RuntimeError("the gated RMSNorm kernel needs triton, which is not installed")
    rows = (h, y) if gate is None else (h, y, gate)
    if h.dim() != 2 or y.shape != h.shape or gate is not None and gate.shape != (h.shape[1],):
        raise ValueError(
            f"expected h, y [N, W] and gate [W]; got h {tuple(h.shape)}, y {tuple(y.shape)}, "
            f"gate {None if gate is None else tuple(gate.shape)}"
        )
    n, w = h.shape
    if {t.dtype for t in rows} != {h.dtype} or h.dtype not in KERNEL_DTYPES:
        raise ValueError(f"h, y and gate must share one dtype of {KERNEL_DTYPES}")
    if w > MAX_WIDTH or any(t.stride(-1) != 1 for t in rows):
        raise RuntimeError(f"gated_rms_norm kernel: width {w} > {MAX_WIDTH} or a strided last dim")
    for name, t in (("scale1", scale1), ("shift", shift)):
        if t is not None and (t.shape != (w,) or t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(
                f"{name} must be a contiguous fp32 [{w}], got {t.dtype} {tuple(t.shape)}"
            )
    s = torch.empty(n, w, dtype=h.dtype, device=h.device)
    out = torch.empty_like(s)
    plan_gated_rms_norm(h, y, gate, scale1, shift, eps, s, out).run()
    return s, out


def gated_rms_norm(h, y, gate, scale1, shift, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA at inference (one modulation row for all rows),
    the reference elsewhere."""
    w = h.shape[-1]
    one_row = scale1.shape == (w,) and shift.shape == (w,) and gate.shape == (w,)
    if one_row and h.dim() == 2 and use_kernel(h, y, gate, scale1, shift):
        out = try_kernel("gated_rms_norm", gated_rms_norm_kernel, h, y, gate, scale1, shift, eps)
        if out is not None:
            return out
    return gated_rms_norm_ref(h, y, gate, scale1, shift, eps)


def add_rms_norm(h, y, weight, eps: float, fused: bool = True) -> tuple[torch.Tensor, ...]:
    """The backbone's residual add and the Gemma RMSNorm after it -> (h + y, its norm with
    1 + weight). Dispatch: one kernel on CUDA at inference (2-D rows, an fp32 [W] weight),
    the reference (the add, then kernels/rms_norm.py) elsewhere and with `fused=False` (the
    two ops as the backbone ran them before: bench latency's `graphs_prev`)."""
    w = h.shape[-1]
    fits = fused and h.dim() == 2 and weight.shape == (w,) and weight.dtype == torch.float32
    if fits and y.shape == h.shape and use_kernel(h, y, weight):
        out = try_kernel("add_rms_norm", gated_rms_norm_kernel, h, y, None, weight, None, eps)
        if out is not None:
            return out
    return add_rms_norm_ref(h, y, weight, eps)


def pi05_launches() -> list[Launch]:
    """The launches at pi05 shapes on meta tensors, for kernels/offline_compile.py: the
    expert's (50 rows, W 1024, bf16) and the backbone's add + RMSNorm (a 704-row prefill,
    W 2048)."""
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    h = torch.empty(50, 1024, **meta)
    vec = torch.empty(1024, device="meta")
    gate = torch.empty(1024, **meta)
    x, w = torch.empty(704, 2048, **meta), torch.empty(2048, device="meta")
    return [plan_gated_rms_norm(h, h, gate, vec, vec, 1e-6, h, h),
            plan_gated_rms_norm(x, x, None, w, None, 1e-6, x, x)]  # fmt: skip
