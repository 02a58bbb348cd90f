"""The action expert's layer-step as CUDA runs it (five kernel calls over the fused weights,
model/expert_step.py) against the CPU's chain: the real model's layers and prefix, the
Triton kernels run under TRITON_INTERPRET=1 (test/conftest.py). Each kernel is tested
against its own reference in test/kernels/; this is the wiring: the right weights, norms,
gates, RoPE tables, prefix rows and mask reach each kernel, in order."""

import pytest
import torch

import embodied_kv.model.expert as expert_module
from embodied_kv.kernels.triton_base import INTERPRETED, triton
from embodied_kv.model.config import get_preset
from embodied_kv.model.expert_step import (
    StepInputs,
    WorkspaceCache,
    fused_ready,
    layer_step_fused,
    layer_step_persistent,
    layer_step_ref,
)
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.model.weight_prefetch import GEMMS

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")
# the kernels on CPU tensors: the interpreter (a GPU machine runs them compiled, on CUDA
# tensors, in test_on_cuda_the_fused_chunk_equals_the_unfused_one)
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="CPU tensors through the kernels need TRITON_INTERPRET=1"
)

# fp32: the kernels sum in another order than the CPU's GEMMs (~1e-6 on values ~1);
# bf16: one bf16 rounding of the many in a layer lands elsewhere (relative ~1e-2).
TOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


def model_and_prefix(dtype, layers=2):
    m = build_model(get_preset("tiny", layers=layers), dtype=dtype)
    fuse_projections(m)  # as build_model does on CUDA
    arena = m.new_arena(2, 128)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 5)))
    return m, arena, slot, arena.slot_len(slot)


def stream(m, dtype, seed):
    """A random residual stream [H, W] for the expert's layers."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m.cfg.action_horizon, m.cfg.expert.width, generator=g).to(dtype)


def inputs_of(m, arena, slot, n, i, k, rows):
    e = m.expert
    steps = m.cfg.denoise_steps
    mod = e.flow_modulation(steps, "cpu")
    ctx = e.context(None, m.cfg.action_horizon, torch.tensor(n), rows, "cpu", None, mod)
    j = 2 * i
    return StepInputs(
        scale1=(mod.scale1[j, k], mod.scale1[j + 1, k]),
        shift=(mod.shift[j, k], mod.shift[j + 1, k]),
        gate=(mod.gate[j, k], mod.gate[j + 1, k]),
        cos_sin=ctx.cos_sin,
        kp=arena.k[i, slot, : ctx.n_rows],
        vp=arena.v[i, slot, : ctx.n_rows],
        bias=ctx.bias,
        scale=e.scale,
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 96])  # exact prefix; a graph's row bucket (masked)
def test_fused_layer_step_equals_the_cpu_chain(dtype, rows):
    m, arena, slot, n = model_and_prefix(dtype)
    h = stream(m, dtype, 1)
    work = WorkspaceCache()
    with torch.no_grad():
        for i, layer in enumerate(m.expert.layers):
            s = inputs_of(m, arena, slot, n, i, k=3, rows=rows)
            want = layer_step_ref(layer, h, s)
            got = layer_step_fused(layer, h, s, work, kernels=True)
            assert got.dtype == want.dtype and got.shape == want.shape
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            assert err <= TOL[dtype] * max(scale, 1.0), (i, err, scale)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, 96])  # exact prefix; a graph's row bucket (masked)
def test_the_persistent_layer_step_is_the_five_kernels_bytewise(dtype, rows, monkeypatch):
    """One persistent launch (kernels/expert_layer_step.py) = the five kernel calls, byte for
    byte under the interpreter (program 0 takes every item in order); twice on one
    workspace: the same bytes, every counter back at 0 and no wait timed out; again with two
    programs a SM (a grid twice as large: the launch's last grab still resets the queue)."""
    import embodied_kv.kernels.expert_layer_step as step_k
    from embodied_kv.kernels.expert_layer_step import StepWork, failed

    m, arena, slot, n = model_and_prefix(dtype)
    h = stream(m, dtype, 4)
    with torch.no_grad():
        for i, layer in enumerate(m.expert.layers):
            s = inputs_of(m, arena, slot, n, i, k=5, rows=rows)
            want = layer_step_fused(layer, h, s, WorkspaceCache(), kernels=True)
            got = layer_step_persistent(layer, h, s, WorkspaceCache(), kernels=True)
            assert torch.equal(got, want), i
    # the launch on a kept workspace (CUDA's WorkspaceCache.step), run twice
    attn, mlp = layer.self_attn, layer.mlp
    heads = (attn.heads, attn.kv_heads, attn.head_dim)
    work = StepWork.new(h, attn.fusion.weight, attn.o_proj.weight, mlp.down_proj.weight, heads,
                        s.kp.shape[0])  # fmt: skip
    from embodied_kv.kernels.expert_layer_step import expert_layer_step_kernel

    args = (h, s.scale1, s.shift, (layer.input_layernorm.eps, layer.post_attention_layernorm.eps),
            s.gate, attn.fusion.weight, heads, *s.cos_sin, s.kp, s.vp, s.bias, s.scale,
            attn.o_proj.weight, mlp.fusion.weight, mlp.down_proj.weight)  # fmt: skip
    counters = [work.phases, work.attention[3], work.o_work[1], work.down_work[1]]
    for per_sm in (1, 2):
        monkeypatch.setattr(step_k, "PROGRAMS_PER_SM", per_sm)
        with torch.no_grad():
            once = expert_layer_step_kernel(*args, work)
            twice = expert_layer_step_kernel(*args, work)
        assert torch.equal(once, want) and torch.equal(twice, want), per_sm
        assert all(int(c.abs().sum()) == 0 for c in counters) and not failed(work)
    launch = step_k.plan_layer_step(*args, work, torch.empty_like(h), per_sm=2)
    assert launch.grid == (2 * 4,)  # work_queue.CPU_PROGRAMS a "SM" off CUDA


@interpreted
@pytest.mark.parametrize("persistent", [False, True])
def test_the_whole_chunk_through_the_fused_path(monkeypatch, persistent):
    """sample() with every layer-step on the five kernels (as on CUDA), as five launches or
    one persistent launch (model/expert.py PERSISTENT_LAYER_STEP) = the CPU's chunk within
    fp32 summation order; the workspace is allocated once per shape and reused."""
    m, arena, slot, n = model_and_prefix(torch.float32)
    noise = m.make_noise(2)
    with torch.no_grad():
        want = m.expert.sample(arena, slot, torch.tensor(n), noise, rows=96)

    def fused(layer, h, s, work, hook=None):
        return layer_step_fused(layer, h, s, work, kernels=True, hook=hook)

    def persistent_step(layer, h, s, work, prefetch=True):
        return layer_step_persistent(layer, h, s, work, kernels=True, prefetch=prefetch)

    monkeypatch.setattr(expert_module, "fused_ready", lambda layer, h: True)
    monkeypatch.setattr(expert_module, "layer_step_fused", fused)
    monkeypatch.setattr(expert_module, "layer_step_persistent", persistent_step)
    m.expert.fused_layer_step = True  # CUDA's default runs the chain (model/expert.py)
    m.expert.persistent_layer_step = persistent
    m.expert.prefetch_log = []  # what CUDA would prefetch (model/weight_prefetch.py)
    with torch.no_grad():
        got = m.expert.sample(arena, slot, torch.tensor(n), noise, rows=96)
    assert (got - want).abs().max().item() < 1e-3
    # five launches: every GEMM's weights one ahead, as the chain; persistent launches
    # prefetch inside (their items, on CUDA): the host only the sample's first q/k/v
    steps = [(k, i) for k in range(m.cfg.denoise_steps) for i in range(len(m.expert.layers))]
    if persistent:
        want_log = [(0, 0, "qkv")]
    else:
        want_log = [(k, i, g) for k, i in steps for g in GEMMS]
    assert m.expert.prefetch_log == want_log
    if not persistent:  # o_proj (K = heads x D) and down (K = mlp)
        assert len(m.expert.workspaces._work) == 2


def test_fused_path_is_only_taken_where_it_applies():
    m, arena, slot, n = model_and_prefix(torch.float32)
    layer, h = m.expert.layers[0], torch.zeros(3, m.cfg.expert.width)
    assert not fused_ready(layer, h)  # CPU tensors: the reference chain, the CPU's bytes
    plain = build_model(get_preset("tiny", layers=1))
    assert plain.expert.layers[0].self_attn.fusion is None  # no fusion on the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the real kernels")
@pytest.mark.parametrize("preset", ["tiny", "pi05"])
def test_on_cuda_the_fused_chunk_equals_the_unfused_one(preset):
    """On a GPU (gpu-check's test run): the compiled kernels, at tiny and pi05 widths."""
    m = build_model(get_preset(preset, layers=1, vision_layers=1), "cuda", torch.bfloat16)
    assert m.expert.layers[0].self_attn.fusion is not None  # build_model fuses on CUDA
    arena = m.new_arena(2, 1024)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 5)))
    n, noise = arena.slot_len(slot), m.make_noise(3)
    chunks = {}
    for fused in (True, False):
        m.expert.fused_layer_step = fused
        with torch.no_grad():
            chunks[fused] = m.expert.sample(arena, slot, torch.tensor(n, device="cuda"), noise,
                                            rows=1024).float()  # fmt: skip
    err = (chunks[True] - chunks[False]).abs().max().item()
    assert err <= 0.05 * max(chunks[False].abs().max().item(), 1.0), err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the real kernels")
def test_on_cuda_the_persistent_layer_step_is_the_five_kernels():
    """On a GPU: the persistent launch (a program per SM, items taken concurrently) against
    the five launches, pi05 widths, the same layer five times on one kept workspace: equal
    within an ulp of bf16 (the same kernels' code; a race would show as far more), no wait
    timed out, counters back at 0."""
    from embodied_kv.kernels.expert_layer_step import failed

    m = build_model(get_preset("pi05", layers=1, vision_layers=1), "cuda", torch.bfloat16)
    arena = m.new_arena(2, 1024)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 5)))
    n = arena.slot_len(slot)
    e, layer = m.expert, m.expert.layers[0]
    mod = e.flow_modulation(m.cfg.denoise_steps, "cuda")
    ctx = e.context(None, m.cfg.action_horizon, torch.tensor(n, device="cuda"), 1024, "cuda",
                    None, mod)  # fmt: skip
    s = StepInputs(
        scale1=(mod.scale1[0, 2], mod.scale1[1, 2]), shift=(mod.shift[0, 2], mod.shift[1, 2]),
        gate=(mod.gate[0, 2], mod.gate[1, 2]), cos_sin=ctx.cos_sin,
        kp=arena.k[0, slot, : ctx.n_rows], vp=arena.v[0, slot, : ctx.n_rows], bias=ctx.bias,
        scale=e.scale,
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(6)
    h = torch.randn(m.cfg.action_horizon, m.cfg.expert.width, generator=g, device="cuda")
    h = h.to(torch.bfloat16)
    work = WorkspaceCache()
    with torch.no_grad():
        want = layer_step_fused(layer, h, s, work)
        for _ in range(5):
            got = layer_step_persistent(layer, h, s, work)
            torch.testing.assert_close(got, want, atol=2**-7, rtol=2**-7)
    (step,) = work._steps.values()
    torch.cuda.synchronize()
    assert not failed(step) and int(step.phases.abs().sum()) == 0 and work.timed_out() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the real kernels")
def test_on_cuda_one_launch_an_euler_step_is_a_launch_a_layer():
    """On a GPU: the three layers of an Euler step in one persistent launch (a LayerTable:
    issue 33 item 1, stage 2) against a persistent launch a layer, pi05 widths, five times
    on one kept workspace: equal within an ulp of bf16, no wait timed out, counters at 0."""
    from embodied_kv.kernels.expert_layer_step import failed
    from embodied_kv.model.expert_step import layers_step_persistent

    m = build_model(get_preset("pi05", layers=3, vision_layers=1), "cuda", torch.bfloat16)
    arena = m.new_arena(2, 1024)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 5)))
    n = arena.slot_len(slot)
    e = m.expert
    mod = e.flow_modulation(m.cfg.denoise_steps, "cuda")
    ctx = e.context(None, m.cfg.action_horizon, torch.tensor(n, device="cuda"), 1024, "cuda",
                    None, mod)  # fmt: skip
    inputs = [e.step_inputs(i, 4, ctx, arena, slot) for i in range(3)]
    g = torch.Generator(device="cuda").manual_seed(8)
    h = torch.randn(m.cfg.action_horizon, m.cfg.expert.width, generator=g, device="cuda")
    h = h.to(torch.bfloat16)
    work = WorkspaceCache()
    with torch.no_grad():
        want = h
        for layer, s in zip(e.layers, inputs, strict=True):
            want = layer_step_persistent(layer, want, s, work)
        for _ in range(5):
            got = layers_step_persistent(list(e.layers), h, inputs, work)
            assert got is not None  # the layers share one launch
            torch.testing.assert_close(got, want, atol=2**-6, rtol=2**-6)
    (step,) = work._steps.values()
    torch.cuda.synchronize()
    assert not failed(step) and int(step.phases.abs().sum()) == 0 and work.timed_out() == 0
