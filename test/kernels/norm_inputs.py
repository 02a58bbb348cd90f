"""Shared inputs for the norm-folded GEMM tests (test_norm_qkv_rope.py, test_norm_gate_up.py):
row counts that end mid-block (1, 7, 50, 67), widths that end mid-K-tile, fp32, bf16 and fp16,
and the tolerance check against an fp32 reference."""

import inspect

import torch

from embodied_kv.model.config import GemmaConfig
from embodied_kv.model.layers import GemmaLayer

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

EPS = 1e-6
LOW_PRECISION_ABS = 1e-3  # beside the factor: an output whose reference error is ~1 ulp
ROWS = [1, 7, 50, 67]  # 50: pi05's action rows; 67: a second, partial 64-row block
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (width, Hq, Hkv, D, hidden)
DIMS = [(96, 2, 1, 16, 80), (48, 3, 1, 48, 40)]


def inputs(n, width, dtype, seed=0, row_stride=None):
    """h [N, W] (row stride `row_stride` if given), scale1 and shift fp32 [W]."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, row_stride or width, generator=g) * 3 + 0.5
    h = wide.to(dtype).to(DEVICE)[:, :width]
    scale1 = (1.0 + 0.3 * torch.randn(width, generator=g)).to(DEVICE)
    shift = (0.3 * torch.randn(width, generator=g)).to(DEVICE)
    return h, scale1, shift


def weight(rows, width, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * width**-0.5).to(dtype).to(DEVICE)


def assert_close_to_exact(out, ref, exact, dtype, what):
    assert out.dtype == dtype and out.shape == exact.shape, what
    err = (out.float() - exact).abs().max().item()
    if dtype == torch.float32:
        assert err <= FP32_TOL, f"{what}: fp32 kernel error {err:.3g}"
        return
    ref_err = (ref.float() - exact).abs().max().item()
    tol = LOW_PRECISION_FACTOR * ref_err + LOW_PRECISION_ABS
    assert err <= tol, f"{what}: kernel error {err:.3g} vs reference error {ref_err:.3g}"


def make_expert_layer(dtype):
    """-> cfg, an adaptive GemmaLayer in `dtype`, h [50, W] and the condition [W]: the
    expert's own modules the CPU path is compared with in bytes."""
    torch.manual_seed(5)
    cfg = GemmaConfig(width=96, layers=1, mlp=80, heads=2, kv_heads=1, head_dim=16)
    layer = GemmaLayer(cfg, adaptive=True).to(dtype)
    n = 50
    h = (torch.randn(n, cfg.width) * 2).to(dtype)
    cond = torch.randn(cfg.width)
    return cfg, layer, h, cond


def assert_args_in_kernel_order(launch):
    assert launch.args[0].shape == (50, 1024) and launch.args[0].dtype == torch.bfloat16
    fn = getattr(launch.kernel, "fn", launch.kernel)  # the interpreter wraps the function
    names = [a for a in inspect.signature(fn).parameters if a not in launch.constexprs]
    assert len(names) == len(launch.args), launch.name
