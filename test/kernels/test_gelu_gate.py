"""GELU-gate kernel (kernels/gelu_gate.py) vs `gelu_gate_ref`, interpreter on CPU:
feature counts that end mid-block, strided rows, fp32 and 16-bit."""

import pytest
import torch

from embodied_kv.kernels.gelu_gate import gelu_gate_kernel, gelu_gate_ref

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

SHAPES = [(1, 7), (5, 1000), (3, 2500), (2, 4096)]  # (rows, features); pi05 expert MLP 4096


def inputs(n, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    both = (torch.randn(n, 2 * f, generator=g) * 2).to(dtype).to(DEVICE)
    return both[:, :f], both[:, f:]  # strided rows, as from a fused projection


@pytest.mark.parametrize("n,f", SHAPES)
def test_kernel_matches_reference_fp32(kernel, n, f):
    gate, up = inputs(n, f, torch.float32)
    out = gelu_gate_kernel(gate, up)
    assert out.shape == gate.shape and out.dtype == gate.dtype
    torch.testing.assert_close(out, gelu_gate_ref(gate, up), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, dtype):
    gate, up = inputs(4, 3000, dtype, seed=1)
    exact = gelu_gate_ref(gate.float(), up.float())
    ref_err = (gelu_gate_ref(gate, up).float() - exact).abs().max()
    out = gelu_gate_kernel(gate, up)
    assert out.dtype == dtype
    assert (out.float() - exact).abs().max() <= LOW_PRECISION_FACTOR * ref_err


def test_mismatched_inputs_are_refused(kernel):
    gate, up = inputs(2, 16, torch.float32)
    with pytest.raises(ValueError, match="must match"):
        gelu_gate_kernel(gate, up[:, :8])
