"""The flow-time modulation kept per weights load (model/flow_constants.py): the bytes the
per-action computation gives, computed once while the weights stay, recomputed in place
(graphs keep reading it) when they change."""

import pytest
import torch

from embodied_kv.engine.graphs import GraphRunner
from embodied_kv.model.config import get_preset
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import assign_state

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


def fresh_model(dtype=torch.float32):
    m = build_model(get_preset("tiny"), dtype=dtype)
    if dtype == torch.bfloat16:
        fuse_projections(m)  # the CUDA configuration
    return m


def prefilled(m, obs=3):
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, obs)))
    return arena, slot, arena.slot_len(slot)


def per_action(m):
    """What every action computed before the cache: the modulation of this call's times."""
    steps = m.cfg.denoise_steps
    times = (1.0 + torch.arange(steps, dtype=torch.float64) * (-1.0 / steps)).float()
    return m.expert.modulation(times)


def same_bytes(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("scale1", "shift", "gate"))


def perturbed_expert_state(m, seed):
    g = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    for k in state:
        if k.startswith("expert.") and ("time_mlp" in k or "layernorm" in k or "norm." in k):
            state[k] += 0.05 * torch.randn(state[k].shape, generator=g).to(state[k].dtype)
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_table_is_the_per_action_bytes_and_computed_once(dtype):
    m = fresh_model(dtype)
    arena, slot, n = prefilled(m)
    cache = m.expert.flow_mods
    with torch.no_grad():
        table = m.expert.flow_modulation(m.cfg.denoise_steps, "cpu")
        assert same_bytes(table, per_action(m))
        first = m.sample_actions(arena, slot, n, m.make_noise(1))
        second = m.sample_actions(arena, slot, n, m.make_noise(1))
    assert cache.computed == 1  # three uses, one computation
    assert torch.equal(first, second)
    # the chunk with the table equals the chunk that recomputes it (the pre-cache path)
    with torch.no_grad():
        mod = per_action(m)
        ctx = m.expert.context(None, m.cfg.action_horizon, torch.tensor(n), 256, "cpu", None, mod)
        x = m.make_noise(1).float()
        for k in range(m.cfg.denoise_steps):
            x = (
                x
                + (-1.0 / m.cfg.denoise_steps)
                * m.expert.velocity_at(x, ctx, k, arena, slot, torch.tensor(n)).float()
            )
    assert torch.equal(x, first)


def test_a_weights_load_refreshes_the_table_in_place():
    m = fresh_model()
    arena, slot, n = prefilled(m)
    noise = m.make_noise(2)
    with torch.no_grad():
        before = m.sample_actions(arena, slot, n, noise)
        table = m.expert.flow_modulation(m.cfg.denoise_steps, "cpu")
        ptr = table.scale1.data_ptr()
        state = perturbed_expert_state(m, 0)
        assign_state(m, state, "perturbed")  # in-place copies, as every loader does
        after = m.sample_actions(arena, slot, n, noise)
        refreshed = m.expert.flow_modulation(m.cfg.denoise_steps, "cpu")
    assert refreshed.scale1.data_ptr() == ptr  # same tensors: graphs keep reading them
    assert same_bytes(refreshed, per_action(m))
    assert not torch.equal(before, after)
    # the same weights in a model that never cached anything: the same chunk
    other = fresh_model()
    with torch.no_grad():
        assign_state(other, state, "perturbed")
        a2, s2, n2 = prefilled(other)
        assert n2 == n
        assert torch.equal(other.sample_actions(a2, s2, n2, noise), after)
    assert m.expert.flow_mods.computed == 2


def test_training_mode_computes_the_modulation_with_its_gradient():
    m = fresh_model()
    with torch.enable_grad():
        mod = m.expert.flow_modulation(m.cfg.denoise_steps, "cpu")
        mod.scale1.sum().backward()
    assert m.expert.flow_mods.computed == 0  # nothing kept from a graph with gradients
    assert m.expert.time_mlp_in.weight.grad is not None
    assert m.expert.time_mlp_in.weight.grad.abs().sum() > 0


def test_a_denoise_graph_sees_new_weights_without_recapture():
    """The emulated graph read the table by reference at capture; after a load, the runner
    refreshes it in place before the replay: the replay equals eager with the new weights."""
    m = fresh_model()
    graphed, slot, n = prefilled(m)
    eager, _, _ = prefilled(m)
    runner = GraphRunner(m, graphed, mode="emulate")
    m.graphs = runner
    noise = m.make_noise(4)
    try:
        with torch.no_grad():
            m.sample_actions(graphed, slot, n, noise)  # captures
            assign_state(m, perturbed_expert_state(m, 1), "perturbed")
            captures = runner.captures
            got = m.sample_actions(graphed, slot, n, noise)
            m.graphs = None
            m.expert.flow_mods.clear()  # eager from scratch
            want = m.sample_actions(eager, slot, n, noise)
    finally:
        m.graphs = None
    assert runner.captures == captures
    assert torch.equal(got, want)


def test_the_clean_table_is_t0_s_bytes_and_refreshed_with_the_weights():
    """CLEAN: the modulation of flow time 0 (training-time RTC's held rows) is kept and
    refreshed like the steps' tables, in place."""
    from embodied_kv.model.flow_constants import CLEAN

    m = fresh_model()
    with torch.no_grad():
        table = m.expert.flow_modulation(CLEAN, "cpu")
        assert same_bytes(table, m.expert.modulation(torch.zeros(1)))
        assert m.expert.flow_modulation(CLEAN, "cpu") is table
        ptr = table.scale1.data_ptr()
        assign_state(m, perturbed_expert_state(m, 1), "perturbed")
        refreshed = m.expert.flow_modulation(CLEAN, "cpu")
        assert refreshed.scale1.data_ptr() == ptr
        assert same_bytes(refreshed, m.expert.modulation(torch.zeros(1)))
    assert m.expert.flow_mods.computed == 2
