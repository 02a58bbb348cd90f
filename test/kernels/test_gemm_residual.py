"""Gated-residual GEMM kernel (kernels/gemm_residual.py) vs `linear_gated_residual_ref`,
interpreter on CPU: row counts and widths that end mid-tile, K chunks that end mid-block (and
an empty last split), SPLIT_K 1 and > 1, fp32 and 16-bit; split-K bytes are deterministic and
the CPU path is today's torch expression byte for byte."""

import pytest
import torch
import torch.nn.functional as F

from embodied_kv.kernels.gemm_residual import (
    GemmConfig,
    gemm_config,
    linear_gated_residual,
    linear_gated_residual_kernel,
    linear_gated_residual_ref,
    pi05_launches,
    split_chunk,
    workspace,
)

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

# (N, W, K, config): N 1 / 7 / 50 (pi05's rows) / 67 (two M tiles); K 160 in 32-blocks is 5
# blocks, so 4 splits of 2 blocks leave the last split empty; 3 splits: not a power of two
CASES = [
    (1, 48, 96, GemmConfig(16, 16, 32, 1)),
    (7, 80, 160, GemmConfig(16, 32, 32, 4)),
    (50, 80, 96, GemmConfig(64, 32, 16, 3)),
    (67, 48, 160, GemmConfig(64, 16, 32, 2)),
    (50, 80, 160, None),  # gemm_config's choice: 2 tiles, split 2 (bf16) / 4 (fp32)
]
BF16_SAME_BYTES = 0.95  # fraction of output elements bytewise equal to the bf16 reference


def inputs(n, width, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2 * k, generator=g)[:, :k]  # strided rows, as a view of a wider buffer
    w = torch.randn(width, k, generator=g) / k**0.5  # nn.Linear-like scale
    h = torch.randn(n, width, generator=g) * 2
    gate = torch.randn(width, generator=g)
    return tuple(t.to(dtype=dtype, device=DEVICE) for t in (h, x, w, gate))


def exact(h, x, w, gate):
    d = torch.float64
    return h.to(d) + gate.to(d) * (x.to(d) @ w.to(d).T)


@pytest.mark.parametrize("n,width,k,cfg", CASES)
def test_kernel_matches_reference_fp32(kernel, n, width, k, cfg):
    h, x, w, gate = inputs(n, width, k, torch.float32)
    out = linear_gated_residual_kernel(h, x, w, gate, cfg=cfg)
    assert out.shape == h.shape and out.dtype == h.dtype and out.data_ptr() != h.data_ptr()
    ref = linear_gated_residual_ref(h, x, w, gate)
    torch.testing.assert_close(out, ref, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("n,width,k,cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, n, width, k, cfg, dtype):
    """Error vs the float64 computation at most LOW_PRECISION_FACTOR x the reference's own."""
    h, x, w, gate = inputs(n, width, k, dtype, seed=1)
    want = exact(h, x, w, gate)
    ref_err = (linear_gated_residual_ref(h, x, w, gate).double() - want).abs().max()
    out = linear_gated_residual_kernel(h, x, w, gate, cfg=cfg)
    assert out.dtype == dtype
    err = (out.double() - want).abs().max()
    assert err <= LOW_PRECISION_FACTOR * ref_err + 1e-6, f"{err:.3g} vs reference {ref_err:.3g}"


def test_bf16_rounds_as_linear_then_addcmul(kernel):
    """x @ w.T is rounded to bf16 before the epilogue, as F.linear's output is: the kernel then
    differs from the reference's bytes only where the summation order flips a rounding
    (interpreter, pi05 shapes: 0-0.004% of elements; without that rounding 16%)."""
    h, x, w, gate = inputs(50, 80, 160, torch.bfloat16, seed=4)
    out = linear_gated_residual_kernel(h, x, w, gate, cfg=GemmConfig(64, 32, 32, 2))
    same = (out == linear_gated_residual_ref(h, x, w, gate)).float().mean()
    assert same >= BF16_SAME_BYTES, f"{same:.4f} of the elements equal the reference's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_is_deterministic_and_leaves_counters_at_zero(kernel, dtype):
    """Two calls sharing one workspace give the same bytes: the sum runs in split order, and
    the last program resets the counters (left at SPLIT_K, the second call would write no
    tile and return torch.empty's contents)."""
    h, x, w, gate = inputs(67, 80, 160, dtype, seed=2)
    cfg = GemmConfig(64, 32, 32, 3)
    work = workspace(67, 80, cfg, DEVICE)
    first = linear_gated_residual_kernel(h, x, w, gate, work, cfg)
    assert torch.equal(work[1], torch.zeros_like(work[1]))
    second = linear_gated_residual_kernel(h, x, w, gate, work, cfg)
    assert torch.equal(first, second)
    single = linear_gated_residual_kernel(h, x, w, gate, cfg=GemmConfig(64, 32, 32, 1))
    tol = FP32_TOL if dtype == torch.float32 else 2**-7  # another summation order: close only
    torch.testing.assert_close(first, single, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_the_torch_expression(dtype):
    h, x, w, gate = (t.cpu() for t in inputs(50, 80, 160, dtype, seed=3))
    assert torch.equal(linear_gated_residual(h, x, w, gate), torch.addcmul(h, F.linear(x, w), gate))


def test_bad_inputs_are_refused(kernel):
    h, x, w, gate = inputs(7, 48, 96, torch.float32)
    with pytest.raises(ValueError, match=r"x \(7, 96\), w \(48, 95\)"):
        linear_gated_residual_kernel(h, x, w[:, :95], gate)
    with pytest.raises(ValueError, match=r"gate \(47,\)"):
        linear_gated_residual_kernel(h, x, w, gate[:47])
    with pytest.raises(ValueError, match=r"h \(7, 48, 1\)"):
        linear_gated_residual_kernel(h[..., None], x, w, gate)
    with pytest.raises(ValueError, match="h torch.float32, x torch.bfloat16"):
        linear_gated_residual_kernel(h, x.bfloat16(), w.bfloat16(), gate)
    with pytest.raises(ValueError, match="x torch.float64"):
        linear_gated_residual_kernel(*(t.double() for t in (h, x, w, gate)))
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        linear_gated_residual_kernel(h, x, w.T.contiguous().T, gate)


def test_pi05_plan_from_shapes():
    """pi05's o_proj and down_proj: one M tile, 32 N tiles of 32, 4 splits (128 programs on
    132 SMs; the tiles an H200 timed fastest), planned on meta tensors."""
    launches = pi05_launches()
    assert [launch.grid for launch in launches] == [(1, 32, 4), (1, 32, 4)]
    assert all(launch.constexprs["SPLIT_K"] == 4 for launch in launches)
    assert len({launch.name for launch in launches}) == 2
    cfg = gemm_config(50, 1024, 4096, torch.bfloat16)
    assert (cfg.block_n, cfg.block_k) == (32, 128)
    assert split_chunk(4096, cfg) == 1024 and split_chunk(2048, cfg) == 512
