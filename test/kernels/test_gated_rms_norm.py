"""The gated residual + adaptive RMSNorm kernel (kernels/gated_rms_norm.py) against
`gated_rms_norm_ref` (addcmul, then the norm: the CPU's bytes), and RoPE over q and k in one
kernel (kernels/rope.py rope_pair) against one rotation each; interpreter on CPU, compiled
on a GPU: irregular widths and rows, strided rows, fp32 and 16-bit."""

import pytest
import torch

from embodied_kv.kernels.gated_rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_kernel,
    gated_rms_norm_ref,
)
from embodied_kv.kernels.rms_norm import rms_norm_kernel, rms_norm_ref
from embodied_kv.kernels.rope import adjacent_heads, rope_kernel, rope_pair, rope_ref

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

EPS = 1e-6
SHAPES = [(1, 48), (7, 100), (50, 1024), (33, 64)]  # pi05's expert: 50 x 1024


def inputs(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, width, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    y = torch.randn(rows, width, generator=g).to(dtype).to(DEVICE)
    gate = (0.5 * torch.randn(width, generator=g)).to(dtype).to(DEVICE)
    scale1 = (1 + 0.1 * torch.randn(width, generator=g)).to(DEVICE)
    shift = (0.1 * torch.randn(width, generator=g)).to(DEVICE)
    return h, y, gate, scale1, shift


@pytest.mark.parametrize("rows,width", SHAPES)
def test_kernel_matches_reference_fp32(kernel, rows, width):
    args = inputs(rows, width, torch.float32)
    s, out = gated_rms_norm_kernel(*args, EPS)
    s_ref, out_ref = gated_rms_norm_ref(*args, EPS)
    torch.testing.assert_close(s, s_ref, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(out, out_ref, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, dtype):
    """The stream: one rounding of the fp32 h + gate * y (torch's addcmul: equal, or one ulp
    where its CPU loop rounds the product first); the norm's error vs fp32 at most
    LOW_PRECISION_FACTOR x the reference's own."""
    args = inputs(50, 1024, dtype, seed=1)
    s, out = gated_rms_norm_kernel(*args, EPS)
    s_ref, out_ref = gated_rms_norm_ref(*args, EPS)
    assert s.dtype == out.dtype == dtype
    exact_s = torch.addcmul(*(a.double() for a in args[:3]))
    ulp = torch.finfo(dtype).eps * exact_s.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((s.double() - exact_s).abs() <= ulp).all()  # within one rounding of exact
    assert (s != s_ref).float().mean() < 0.01
    exact = rms_norm_ref(s.double(), args[3].double(), EPS, args[4].double())
    ref_err = (out_ref.double() - rms_norm_ref(s_ref.double(), args[3].double(), EPS,
                                               args[4].double())).abs().max()  # fmt: skip
    assert (out.double() - exact).abs().max() <= LOW_PRECISION_FACTOR * ref_err


def test_kernel_reads_strided_rows(kernel):
    h, y, gate, scale1, shift = inputs(12, 64, torch.float32, seed=2)
    wide_h = torch.cat([h, h], dim=1)[:, :64]  # row stride 128
    wide_y = torch.cat([y, y, y], dim=1)[:, 64:128]  # row stride 192, offset 64
    s, out = gated_rms_norm_kernel(wide_h, wide_y, gate, scale1, shift, EPS)
    s_ref, out_ref = gated_rms_norm_ref(h, y, gate, scale1, shift, EPS)
    torch.testing.assert_close(s, s_ref, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(out, out_ref, atol=FP32_TOL, rtol=FP32_TOL)


def test_bad_inputs_are_refused(kernel):
    h, y, gate, scale1, shift = inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_kernel(h, y, gate[:32], scale1, shift, EPS)
    with pytest.raises(ValueError, match="one dtype"):
        gated_rms_norm_kernel(h, y.double(), gate, scale1, shift, EPS)
    with pytest.raises(ValueError, match="scale1"):
        gated_rms_norm_kernel(h, y, gate, scale1.half(), shift, EPS)


def test_the_cpu_dispatch_is_addcmul_then_the_norm_in_bytes():
    args = [a.cpu() for a in inputs(7, 100, torch.bfloat16, seed=3)]
    s, out = gated_rms_norm(*args, EPS)
    h, y, gate, scale1, shift = args
    want = torch.addcmul(h, y, gate)
    assert torch.equal(s, want) and torch.equal(out, rms_norm_ref(want, scale1, EPS, shift))


def qkv_views(n, hq, hkv, d, dtype, seed=0):
    """q, k, v as the fused q/k/v GEMM leaves them: views of one [N, (Hq + 2 Hkv) D] buffer."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q, k, v = out.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)


def tables(n, d):
    ang = torch.randn(n, 1, d // 2, generator=torch.Generator().manual_seed(9))
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([-ang.sin(), ang.sin()], -1)
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 1, 256), (4, 2, 16), (6, 2, 48)])
def test_one_rotation_over_q_and_k_is_each_one_in_bytes(kernel, dtype, heads):
    hq, hkv, d = heads
    q, k, v = qkv_views(5, hq, hkv, d, dtype)
    cos, sin = tables(5, d)
    assert adjacent_heads(q, k) and not adjacent_heads(k, q) and not adjacent_heads(q, v)
    both = q.as_strided((5, hq + hkv, d), q.stride(), q.storage_offset())
    out = rope_kernel(both, cos, sin)
    assert torch.equal(out[:, :hq], rope_kernel(q, cos, sin))
    assert torch.equal(out[:, hq:], rope_kernel(k, cos, sin))
    torch.testing.assert_close(out[:, :hq], rope_ref(q, cos, sin), atol=FP32_TOL, rtol=0.01)
    rq, rk = rope_pair(q, k, cos, sin)  # the dispatcher: one kernel on CUDA, refs on a CPU
    if DEVICE == "cpu":
        assert torch.equal(rq, rope_ref(q, cos, sin)) and torch.equal(rk, rope_ref(k, cos, sin))
    else:
        assert torch.equal(rq, out[:, :hq]) and torch.equal(rk, out[:, hq:])


def test_separate_buffers_are_not_adjacent():
    q = torch.randn(3, 4, 16)
    k = torch.randn(3, 1, 16)
    assert not adjacent_heads(q, k)
    q2, k2, _ = qkv_views(3, 4, 1, 16, torch.float32)
    assert not adjacent_heads(q2[:2], k2[:2].clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 48), (7, 100), (33, 2048)])  # pi05's backbone: 2048
def test_add_rms_norm_is_the_add_then_the_rms_norm_kernel_bytewise(kernel, dtype, rows, width):
    """The backbone's residual add + Gemma RMSNorm (no gate, no shift, 1 + weight): the same
    bytes as torch's add followed by kernels/rms_norm.py's kernel, which CUDA ran before;
    within fp32 tolerance of the CPU's reference."""
    h, y, _, _, _ = inputs(rows, width, dtype, seed=5)
    weight = (0.2 * torch.randn(width, generator=torch.Generator().manual_seed(6))).to(DEVICE)
    s, out = gated_rms_norm_kernel(h, y, None, weight, None, EPS)
    s_ref = h + y
    assert torch.equal(s, s_ref)
    assert torch.equal(out, rms_norm_kernel(s_ref, weight, EPS, None, True))
    ref = add_rms_norm_ref(h.float(), y.float(), weight, EPS)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref[1], atol=tol, rtol=tol)


def test_add_rms_norm_dispatch_on_this_device():
    """On a CPU the dispatcher runs the reference ops (the CPU's bytes); on CUDA the kernel."""
    h, y, _, _, _ = inputs(7, 100, torch.float32, seed=7)
    weight = 0.1 * torch.ones(100, device=DEVICE)
    got = add_rms_norm(h, y, weight, EPS)
    want = add_rms_norm_ref(h, y, weight, EPS)
    if DEVICE == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=FP32_TOL, rtol=FP32_TOL)
