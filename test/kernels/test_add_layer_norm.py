"""Fused residual add + LayerNorm (kernels/add_layer_norm.py) vs `add_layer_norm_ref`,
interpreter on CPU: irregular widths and row counts, strided rows, fp32 and 16-bit."""

import pytest
import torch

from embodied_kv.kernels.add_layer_norm import add_layer_norm_kernel, add_layer_norm_ref

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

EPS = 1e-6
# (rows, width): one row, widths that are no power of two, SigLIP's 1152 (pi05) and 64 (tiny)
SHAPES = [(1, 48), (7, 100), (33, 64), (5, 1152)]


def inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    y = torch.randn(rows, width, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    b = (0.1 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    return x, y, w, b


@pytest.mark.parametrize("rows,width", SHAPES)
def test_kernel_matches_reference_fp32(kernel, rows, width):
    x, y, w, b = inputs(rows, width, torch.float32)
    s, out = add_layer_norm_kernel(x, y, w, b, EPS)
    s_ref, out_ref = add_layer_norm_ref(x, y.clone(), w, b, EPS)
    assert torch.equal(s, s_ref)  # one fp32 add either way
    torch.testing.assert_close(out, out_ref, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, dtype):
    """The stream is the 16-bit sum (bit-equal to torch's add); the norm's error vs fp32 at
    most LOW_PRECISION_FACTOR x the reference's own."""
    x, y, w, b = inputs(9, 1152, dtype, seed=1)
    s, out = add_layer_norm_kernel(x, y, w, b, EPS)
    s_ref, out_ref = add_layer_norm_ref(x, y.clone(), w, b, EPS)
    assert s.dtype == out.dtype == dtype and torch.equal(s, s_ref)
    exact = add_layer_norm_ref(x.float(), y.float(), w.float(), b.float(), EPS)[1]
    ref_err = (out_ref.float() - exact).abs().max()
    assert (out.float() - exact).abs().max() <= LOW_PRECISION_FACTOR * ref_err


def test_kernel_reads_strided_rows(kernel):
    x, y, w, b = inputs(12, 64, torch.float32, seed=2)
    wide_x = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    wide_y = torch.cat([y, y, y], dim=1)[:, 64:128]  # row stride 192, offset 64
    s, out = add_layer_norm_kernel(wide_x, wide_y, w, b, EPS)
    s_ref, out_ref = add_layer_norm_ref(x, y.clone(), w, b, EPS)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(out, out_ref, atol=FP32_TOL, rtol=FP32_TOL)


def test_reference_is_add_then_layer_norm():
    x, y, w, b = inputs(5, 100, torch.bfloat16, seed=3)
    s, out = add_layer_norm_ref(x, y.clone(), w, b, EPS)
    assert torch.equal(s, x + y)
    assert torch.equal(out, torch.nn.functional.layer_norm(x + y, (100,), w, b, EPS))


def test_bad_inputs_are_refused(kernel):
    x, y, w, b = inputs(2, 64, torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        add_layer_norm_kernel(x, y.half(), w, b, EPS)
    with pytest.raises(ValueError, match=r"\[64\]"):
        add_layer_norm_kernel(x, y, w[:32], b, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        add_layer_norm_kernel(x.t(), y.t(), w[:2], b[:2], EPS)
