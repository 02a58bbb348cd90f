"""RoPE kernel (kernels/rope.py) vs `rope_ref`, interpreter on CPU: irregular token and
head counts, a head_dim that is no power of two, strided q/k views, fp32 and 16-bit."""

import pytest
import torch

from embodied_kv.kernels.rope import rope_kernel, rope_ref
from embodied_kv.model.layers import Rope

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

# (tokens, heads, head_dim): pi05 q (8 heads) and k (1 head) at D 256, odd shapes
SHAPES = [(1, 1, 16), (7, 3, 48), (13, 8, 256), (5, 1, 256), (9, 6, 100)]


def inputs(n, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rope = Rope(d, 4096, 10_000.0)
    position = torch.randint(0, 4096, (n,), generator=g)
    cos, sin = rope.at(position)  # [N, 1, D] fp32
    x = torch.randn(n, h, d, generator=g).to(dtype)
    return x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("n,h,d", SHAPES)
def test_kernel_matches_reference_fp32(kernel, n, h, d):
    x, cos, sin = inputs(n, h, d, torch.float32)
    out = rope_kernel(x, cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, rope_ref(x, cos, sin), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, dtype):
    x, cos, sin = inputs(11, 8, 256, dtype, seed=1)
    exact = rope_ref(x.float(), cos, sin)
    ref_err = (rope_ref(x, cos, sin).float() - exact).abs().max()
    out = rope_kernel(x, cos, sin)
    assert out.dtype == dtype
    assert (out.float() - exact).abs().max() <= LOW_PRECISION_FACTOR * ref_err


def test_kernel_reads_strided_heads(kernel):
    """q and k as views of one fused projection output [N, Hq + Hkv, D]."""
    x, cos, sin = inputs(6, 5, 32, torch.float32, seed=2)
    q, k = x[:, :4], x[:, 4:]
    torch.testing.assert_close(rope_kernel(q, cos, sin), rope_ref(q, cos, sin))
    torch.testing.assert_close(rope_kernel(k, cos, sin), rope_ref(k, cos, sin))


def test_bad_tables_are_refused(kernel):
    x, cos, sin = inputs(4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        rope_kernel(x, cos.half(), sin)
    with pytest.raises(ValueError, match=r"\[4, 1, 32\]"):
        rope_kernel(x, cos[:3], sin)
