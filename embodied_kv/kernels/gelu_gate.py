"""Gemma's gated MLP activation, gelu_tanh(gate) * up, as one kernel.

In torch it is two passes over the [N, MLP] activations (GELU, then the product): at pi05
a 576-row prefill moves ~1.7 GB through them over 18 layers, and the expert's 10 Euler
steps launch 360 of them. Here each element is read from gate and up once and written once.

Supported range: gate and up [N, F] of one dtype (fp32, bf16, fp16), contiguous rows (any
row stride); output contiguous in their dtype. `gelu_gate_ref` is the model's torch code:
the CPU runs it, so CPU bytes are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import INTERPRETED, Launch, tl, triton, use_kernel

BLOCK = 1024  # elements of one row per program


def gelu_gate_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., F] -> gelu_tanh(gate) * up [..., F], their dtype."""
    return F.gelu(gate, approximate="tanh") * up


if triton is not None:
    from embodied_kv.kernels.triton_base import round_bf16

    @triton.jit
    def _gelu_gate_fwd(
        gate_ptr,  # [N, F] gate projection
        up_ptr,  # [N, F] up projection
        out_ptr,  # [N, F] contiguous output
        n_feat,  # F
        stride_g,  # gate stride over rows (elements)
        stride_u,  # up stride over rows
        BLOCK_F: tl.constexpr,  # features per program
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):
        # grid (N, cdiv(F, BLOCK_F)): program (n, b) owns features [b*BLOCK_F, (b+1)*BLOCK_F)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = offs < n_feat
        g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi): torch's tanh GELU
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        y = round_bf16(0.5 * g * (1.0 + tanh) * u, ROUND_BF16)
        tl.store(out_ptr + row * n_feat + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def plan_gelu_gate(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> Launch:
    """The one launch: grid (N, cdiv(F, BLOCK)); a program streams BLOCK features of a row."""
    n, f = gate.shape
    return Launch(
        name=f"gelu_gate {str(gate.dtype).removeprefix('torch.')} F={f}",
        kernel=_gelu_gate_fwd,
        grid=(n, -(-f // BLOCK)),
        args=(gate, up, out, f, gate.stride(0), up.stride(0)),
        constexprs={"BLOCK_F": BLOCK, "ROUND_BF16": INTERPRETED and out.dtype == torch.bfloat16},
        num_warps=4,
        num_stages=1,
    )


def gelu_gate_kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the GELU-gate kernel needs triton, which is not installed")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must match: {gate.dtype} {tuple(gate.shape)} vs "
            f"{up.dtype} {tuple(up.shape)}"
        )
    f = gate.shape[-1]
    g, u = gate.reshape(-1, f), up.reshape(-1, f)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        raise RuntimeError("gelu_gate kernel: the last dim must be contiguous")
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    plan_gelu_gate(g, u, out).run()
    return out.view(gate.shape)


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if use_kernel(gate, up):
        out = try_kernel("gelu_gate", gelu_gate_kernel, gate, up)
        if out is not None:
            return out
    return gelu_gate_ref(gate, up)
