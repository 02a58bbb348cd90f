"""The expert's fp32 in / out projections as one kernel each (kernels/flow_io.py) against
their references (the model's torch ops, the CPU's bytes): interpreter on CPU, compiled on
a GPU; pi05's shapes and irregular ones, a 16-bit hidden state, the expert's whole chunk."""

import pytest
import torch

import embodied_kv.model.expert as expert_module
from embodied_kv.kernels import flow_io
from embodied_kv.kernels.flow_io import (
    action_in,
    action_in_kernel,
    action_in_ref,
    euler_out,
    euler_out_kernel,
    euler_out_ref,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

from .conftest import DEVICE, FP32_TOL

SHAPES = [(50, 32, 1024), (7, 5, 33), (3, 9, 100), (1, 8, 64)]  # (H, A, W)


def tensors(h, a, w, seed=0, hidden=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(h, a, generator=g)
    xn = torch.randn(h, w, generator=g).to(hidden)
    w_in, b_in = torch.randn(w, a, generator=g) * a**-0.5, torch.randn(w, generator=g) * 0.1
    w_out, b_out = torch.randn(a, w, generator=g) * w**-0.5, torch.randn(a, generator=g) * 0.1
    return [t.to(DEVICE) for t in (x, xn, w_in, b_in, w_out, b_out)]


@pytest.mark.parametrize("h,a,w", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_action_in_matches_reference(kernel, h, a, w, dtype):
    x, _, w_in, b_in, _, _ = tensors(h, a, w)
    got, want = action_in_kernel(x, w_in, b_in, dtype), action_in_ref(x, w_in, b_in, dtype)
    assert got.dtype == dtype and got.shape == (h, w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=FP32_TOL)
    else:  # one rounding of nearly the same fp32 value: equal or one bf16 ulp apart
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("h,a,w", SHAPES)
@pytest.mark.parametrize("hidden", [torch.float32, torch.bfloat16])
def test_euler_out_matches_reference(kernel, h, a, w, hidden):
    x, xn, _, _, w_out, b_out = tensors(h, a, w, seed=1, hidden=hidden)
    got = euler_out_kernel(x, xn, w_out, b_out, -0.1)
    want = euler_out_ref(x, xn, w_out, b_out, -0.1)
    assert got.dtype == torch.float32 and got.shape == (h, a)
    torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=FP32_TOL)


def test_bad_inputs_are_refused(kernel):
    x, xn, w_in, b_in, w_out, b_out = tensors(4, 8, 64)
    with pytest.raises(ValueError, match="expected"):
        action_in_kernel(x, w_in[:, :4], b_in, torch.float32)
    with pytest.raises(ValueError, match="fp32"):
        euler_out_kernel(x, xn, w_out.half(), b_out, 0.1)
    with pytest.raises(ValueError, match="x must be fp32"):
        euler_out_kernel(x[:3], xn, w_out, b_out, 0.1)


def test_the_cpu_dispatch_is_the_models_ops_in_bytes():
    x, xn, w_in, b_in, w_out, b_out = (t.cpu() for t in tensors(5, 8, 64, seed=2))
    lin_in, lin_out = torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)
    with torch.no_grad():
        lin_in.weight.copy_(w_in), lin_in.bias.copy_(b_in)
        lin_out.weight.copy_(w_out), lin_out.bias.copy_(b_out)
        assert torch.equal(action_in(x, w_in, b_in, torch.bfloat16),
                           lin_in(x).to(torch.bfloat16))  # fmt: skip
        assert torch.equal(euler_out(x, xn, w_out, b_out, -0.1), x + -0.1 * lin_out(xn).float())


def test_the_whole_chunk_through_the_kernels(kernel, monkeypatch):
    """sample() with both projections on the kernels = the chunk of the torch ops within fp32
    summation order (the bf16 expert's hidden state feeds the head)."""
    m = build_model(get_preset("tiny"), dtype=torch.bfloat16)
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 4)))
    n, noise = torch.tensor(arena.slot_len(slot)), m.make_noise(5)
    want = m.expert.sample(arena, slot, n, noise)
    calls = []

    def counted(kern):
        def run(*args):
            calls.append(kern.__name__)
            return kern(*args)
        return run

    monkeypatch.setattr(expert_module, "action_in", counted(flow_io.action_in_kernel))
    monkeypatch.setattr(expert_module, "euler_out", counted(flow_io.euler_out_kernel))
    got = m.expert.sample(arena, slot, n, noise)
    steps = m.cfg.denoise_steps
    assert calls.count("action_in_kernel") == calls.count("euler_out_kernel") == steps
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
