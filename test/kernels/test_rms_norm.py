"""Fused RMSNorm kernel (kernels/rms_norm.py) vs `rms_norm_ref`, interpreter on CPU:
plain (Gemma, 1 + weight) and adaptive (pi0.5, (1 + scale) and shift), irregular widths
and row counts, fp32 and 16-bit inputs."""

import pytest
import torch

from embodied_kv.kernels.rms_norm import rms_norm_kernel, rms_norm_ref

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

EPS = 1e-6
# (rows, width): one row, a width that is no power of two, pi05's expert / backbone widths
SHAPES = [(1, 48), (7, 100), (33, 64), (5, 1024), (3, 2048)]


def inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    mult = (torch.randn(width, generator=g) * 0.1).to(DEVICE)
    shift = (torch.randn(width, generator=g) * 0.1).to(DEVICE)
    return x, mult, shift


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("adaptive", [False, True])
def test_kernel_matches_reference_fp32(kernel, rows, width, adaptive):
    x, mult, shift = inputs(rows, width, torch.float32)
    kw = {"shift": shift} if adaptive else {"add_one": True}
    out = rms_norm_kernel(x, mult, EPS, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm_ref(x, mult, EPS, **kw), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adaptive", [False, True])
def test_kernel_low_precision(kernel, dtype, adaptive):
    """Error vs the fp32 computation at most LOW_PRECISION_FACTOR x the reference's own."""
    x, mult, shift = inputs(9, 1000, dtype, seed=1)
    kw = {"shift": shift} if adaptive else {"add_one": True}
    exact = rms_norm_ref(x.float(), mult, EPS, **kw)
    ref_err = (rms_norm_ref(x, mult, EPS, **kw).float() - exact).abs().max()
    out = rms_norm_kernel(x, mult, EPS, **kw)
    assert out.dtype == dtype
    assert (out.float() - exact).abs().max() <= LOW_PRECISION_FACTOR * ref_err


def test_kernel_reads_strided_rows_and_keeps_leading_dims(kernel):
    """A [N, H, D] view with a row stride (the expert's q/k slices) and a 3-d input."""
    x, mult, shift = inputs(12, 64, torch.float32, seed=2)
    wide = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    torch.testing.assert_close(
        rms_norm_kernel(wide, mult, EPS, shift), rms_norm_ref(x, mult, EPS, shift)
    )
    x3 = x.view(3, 4, 64)
    out = rms_norm_kernel(x3, mult, EPS, add_one=True)
    assert out.shape == (3, 4, 64)
    torch.testing.assert_close(out, rms_norm_ref(x3, mult, EPS, add_one=True))


def test_bad_parameters_are_refused(kernel):
    x, mult, _ = inputs(2, 64, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        rms_norm_kernel(x, mult.half(), EPS)
    with pytest.raises(ValueError, match=r"\[64\]"):
        rms_norm_kernel(x, mult[:32], EPS)
