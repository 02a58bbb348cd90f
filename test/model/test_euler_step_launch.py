"""Every layer of an Euler step in one persistent launch (kernels/expert_layer_step.py with a
LayerTable; model/expert_step.py layers_step_persistent; issue 33 item 1, stage 2) against
one launch a layer, byte for byte under TRITON_INTERPRET=1 (program 0 takes every item of
every layer in order): the per-layer weights, modulation rows, K/V and mask each layer's
items read, the stream handed between layers, the counters back at 0; and the tables
refused where layers cannot share a launch."""

import pytest
import torch

import embodied_kv.model.expert as expert_module
from embodied_kv.kernels import expert_layer_step as step_kernels
from embodied_kv.kernels import layer_table as layer_tables
from embodied_kv.kernels.triton_base import INTERPRETED, triton
from embodied_kv.model.expert_step import (
    StepInputs,
    WorkspaceCache,
    layer_step_persistent,
    layers_step_persistent,
)

from .test_expert_step import model_and_prefix, stream

pytestmark = [
    pytest.mark.skipif(triton is None, reason="triton is not installed"),
    pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the kernels need "
                       "TRITON_INTERPRET=1 (a GPU runs the CUDA test in test_expert_step.py)"),
]  # fmt: skip


def all_inputs(m, arena, slot, n, k, rows):
    e = m.expert
    mod = e.flow_modulation(m.cfg.denoise_steps, "cpu")
    ctx = e.context(None, m.cfg.action_horizon, torch.tensor(n), rows, "cpu", None, mod)
    return [e.step_inputs(i, k, ctx, arena, slot) for i in range(len(e.layers))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 96])  # exact prefix; a graph's row bucket (masked)
def test_the_layers_in_one_launch_are_one_launch_a_layer_bytewise(dtype, rows):
    m, arena, slot, n = model_and_prefix(dtype, layers=3)
    h = stream(m, dtype, 7)
    layers = list(m.expert.layers)
    with torch.no_grad():
        inputs = all_inputs(m, arena, slot, n, k=4, rows=rows)
        want = h
        for layer, s in zip(layers, inputs, strict=True):
            want = layer_step_persistent(layer, want, s, WorkspaceCache(), kernels=True)
        work = WorkspaceCache()
        table = work.layer_table(layers, inputs)
        assert table is not None and table.layers == len(layers)
        step = (arena.k[1].data_ptr() - arena.k[0].data_ptr()) // arena.k.element_size()
        assert table.stride_kv == step and table.stride_bias == 0  # one mask for all
        got = layers_step_persistent(layers, h, inputs, work, kernels=True)
    assert torch.equal(got, want)
    assert not torch.equal(got, h)


def test_the_launch_is_reused_and_leaves_its_counters_at_zero():
    """On a kept StepWork (as CUDA keeps it), twice: the same bytes, every counter at 0."""
    m, arena, slot, n = model_and_prefix(torch.float32, layers=3)
    layers = list(m.expert.layers)
    h = stream(m, torch.float32, 2)
    with torch.no_grad():
        inputs = all_inputs(m, arena, slot, n, k=2, rows=96)
        table = WorkspaceCache().layer_table(layers, inputs)
        layer, s = layers[0], inputs[0]
        attn, mlp = layer.self_attn, layer.mlp
        heads = (attn.heads, attn.kv_heads, attn.head_dim)
        work = step_kernels.StepWork.new(h, attn.fusion.weight, attn.o_proj.weight,
                                         mlp.down_proj.weight, heads, s.kp.shape[0])  # fmt: skip
        args = (h, s.scale1, s.shift, (layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps), s.gate, attn.fusion.weight, heads,
                *s.cos_sin, s.kp, s.vp, s.bias, s.scale, attn.o_proj.weight,
                mlp.fusion.weight, mlp.down_proj.weight)  # fmt: skip
        once = step_kernels.expert_layer_step_kernel(*args, work, table=table)
        twice = step_kernels.expert_layer_step_kernel(*args, work, table=table)
    assert torch.equal(once, twice)
    counters = [work.phases, work.attention[3], work.o_work[1], work.down_work[1]]
    assert all(int(c.abs().sum()) == 0 for c in counters) and not step_kernels.failed(work)


def test_sample_through_one_launch_an_euler_step_is_the_per_layer_chunk(monkeypatch):
    """sample() with the fused path and PERSISTENT_EULER_STEP (as CUDA would take it): the
    chunk of one launch a layer, byte for byte."""
    m, arena, slot, n = model_and_prefix(torch.float32, layers=2)
    noise = m.make_noise(3)
    calls = []

    def per_layer(layer, h, s, work, kernels=False, prefetch=True):
        return layer_step_persistent(layer, h, s, work, kernels=True, prefetch=prefetch)

    def one_launch(layers, h, inputs, work, kernels=False, prefetch=True):
        calls.append(len(layers))
        return layers_step_persistent(layers, h, inputs, work, kernels=True, prefetch=prefetch)

    monkeypatch.setattr(expert_module, "fused_ready", lambda layer, h: True)
    monkeypatch.setattr(expert_module, "layer_step_persistent", per_layer)
    monkeypatch.setattr(expert_module, "layers_step_persistent", one_launch)
    m.expert.fused_layer_step = m.expert.persistent_layer_step = True
    with torch.no_grad():
        m.expert.persistent_euler_step = False
        want = m.expert.sample(arena, slot, torch.tensor(n), noise, rows=96)
        m.expert.persistent_euler_step = True
        got = m.expert.sample(arena, slot, torch.tensor(n), noise, rows=96)
    assert torch.equal(got, want)
    assert calls == [2] * m.cfg.denoise_steps  # one launch an Euler step


def test_layers_that_cannot_share_a_launch_are_refused():
    m, arena, slot, n = model_and_prefix(torch.float32, layers=3)
    layers = list(m.expert.layers)
    with torch.no_grad():
        inputs = all_inputs(m, arena, slot, n, k=0, rows=96)
        # K/V not at equal steps: views of one buffer 0, 1 and 3 layers' rows in
        rows = inputs[0].kp.numel()
        buf = torch.zeros(4 * rows)
        kp = [buf[o * rows : (o + 1) * rows].view_as(inputs[0].kp) for o in (0, 1, 3)]
        uneven = [StepInputs(s.scale1, s.shift, s.gate, s.cos_sin, k, s.vp, s.bias, s.scale)
                  for s, k in zip(inputs, kp, strict=True)]  # fmt: skip
        assert WorkspaceCache().layer_table(layers, uneven) is None
        # a weight of another shape
        weights = [(x.self_attn.fusion.weight, x.self_attn.o_proj.weight, x.mlp.fusion.weight,
                    x.mlp.down_proj.weight) for x in layers]  # fmt: skip
        weights[1] = (weights[1][0][:-1], *weights[1][1:])
        assert layer_tables.weight_offsets(weights) is None
        # on a CPU without kernels=True: the caller's layer-by-layer path
        h = torch.zeros(m.cfg.action_horizon, m.cfg.expert.width)
        assert layers_step_persistent(layers, h, inputs, WorkspaceCache()) is None
