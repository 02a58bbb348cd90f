"""Norm-folded gate/up GEMM with the GELU gate (kernels/norm_gate_up.py) vs its reference,
interpreter on CPU: row counts that end mid-block (1, 7, 50, 67), widths that end mid-K-tile,
hidden sizes that end mid-column-block, fp32, bf16 and fp16; the CPU path's bytes against the
model's own modules; refused shapes; the pi05 launch."""

import pytest
import torch
import torch.nn.functional as F

from embodied_kv.kernels.norm_gate_up import (
    norm_gate_up,
    norm_gate_up_kernel,
    norm_gate_up_ref,
    pi05_launches,
)

from .norm_inputs import (
    DIMS,
    DTYPES,
    EPS,
    ROWS,
    assert_args_in_kernel_order,
    assert_close_to_exact,
    inputs,
    make_expert_layer,
    weight,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("dims", DIMS)
def test_gate_up_matches_reference(kernel, dims, n, dtype):
    width, *_, hidden = dims
    h, scale1, shift = inputs(n, width, dtype, seed=3)
    w = weight(2 * hidden, width, dtype, seed=4)
    out = norm_gate_up_kernel(h, scale1, shift, EPS, w, hidden)
    ref = norm_gate_up_ref(h, scale1, shift, EPS, w, hidden)
    exact = norm_gate_up_ref(h.float(), scale1, shift, EPS, w.float(), hidden)
    assert out.is_contiguous()
    assert_close_to_exact(out, ref, exact, dtype, "gelu(gate) * up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_the_model_chain_in_bytes(dtype):
    """The dispatcher on CPU tensors against the expert's own GatedMLP (velocity_at's chain:
    AdaRMSNorm.modulate, GatedMLP), compared with torch.equal."""
    cfg, layer, h, cond = make_expert_layer(dtype)
    mlp = layer.mlp
    with torch.no_grad():
        post = layer.post_attention_layernorm.float()
        scale1, shift, _ = post.modulation(cond)
        want_mlp = mlp(post.modulate(h, scale1, shift))  # down_proj(gelu(gate) * up)
        w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        act = norm_gate_up(h, scale1, shift, post.eps, w_gate_up, cfg.mlp)
        assert torch.equal(F.linear(act, mlp.down_proj.weight), want_mlp)


def test_bad_shapes_are_refused(kernel):
    width, d = 64, 16
    h, scale1, shift = inputs(4, width, torch.float32)
    w = weight(4 * d, width, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be torch.float32 \[160, 64\].*\(64, 64\)"):
        norm_gate_up_kernel(h, scale1, shift, EPS, w, 80)
    with pytest.raises(ValueError, match=r"shift must be a contiguous fp32"):
        norm_gate_up_kernel(h, scale1, shift.half(), EPS, w, 32)
    with pytest.raises(ValueError, match=r"h must be \[N, W\].*\(4, 1, 64\)"):
        norm_gate_up_kernel(h[:, None], scale1, shift, EPS, w, 32)


def test_pi05_launch_covers_the_expert_step():
    """One launch at pi05 expert shapes; arguments in the kernel's order."""
    (gate_up,) = pi05_launches()
    assert gate_up.grid == (1, 4096 // 32)
    assert gate_up.constexprs["BLOCK_K"] == 128  # bf16 (an H200's fastest); fp32 keeps 64
    assert_args_in_kernel_order(gate_up)
