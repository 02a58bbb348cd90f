"""The action chunk: a function of (weights, observation, noise seed) only."""

import numpy as np
import torch

from embodied_kv.model.config import get_preset
from embodied_kv.model.hf_interop import arena_to_dynamic_cache, sample_actions_hf_style
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

# fp32: ours reads the prefix in place with a split softmax; LeRobot's way concatenates
# it with the suffix and uses HF's eager attention. Measured max |diff| ~5e-7.
HF_STYLE_ATOL = 1e-5


def chunk(model, obs, seed, arena=None):
    arena = arena or model.new_arena(2, 256)
    slot = arena.allocate()
    prefix = model.embed_prefix(obs)
    model.prefill(arena, slot, prefix)
    return model.sample_actions(arena, slot, prefix.embeds.shape[0], model.make_noise(seed))


def test_same_seed_and_inputs_give_the_same_chunk(tiny_model):
    cfg = tiny_model.cfg
    a = chunk(tiny_model, synthetic_observation(cfg, 1), seed=5)
    b = chunk(tiny_model, synthetic_observation(cfg, 1), seed=5)
    assert a.shape == (cfg.action_horizon, cfg.action_dim)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)


def test_chunk_depends_on_seed_and_observation(tiny_model):
    cfg = tiny_model.cfg
    base = chunk(tiny_model, synthetic_observation(cfg, 1), seed=5)
    other_seed = chunk(tiny_model, synthetic_observation(cfg, 1), seed=6)
    other_images = chunk(tiny_model, synthetic_observation(cfg, 2), seed=5)
    obs = synthetic_observation(cfg, 1)
    obs.state = np.clip(obs.state + 0.5, -1, 1)
    other_state = chunk(tiny_model, obs, seed=5)
    other_task = chunk(tiny_model, synthetic_observation(cfg, 1, "open the drawer"), seed=5)
    one_camera = chunk(tiny_model, synthetic_observation(cfg, 1, camera_mask=(True, False)), seed=5)
    for other in (other_seed, other_images, other_state, other_task, one_camera):
        assert (other - base).abs().max().item() > 1e-3


def test_sampling_reads_the_prefix_slot_without_writing_it(tiny_model):
    cfg = tiny_model.cfg
    arena = tiny_model.new_arena(2, 256)
    slot = arena.allocate()
    prefix = tiny_model.embed_prefix(synthetic_observation(cfg, 4))
    tiny_model.prefill(arena, slot, prefix)
    k, v, length = arena.k.clone(), arena.v.clone(), arena.length.clone()
    n = prefix.embeds.shape[0]
    first = tiny_model.sample_actions(arena, slot, n, tiny_model.make_noise(0))
    second = tiny_model.sample_actions(arena, slot, n, tiny_model.make_noise(0))
    assert torch.equal(first, second)
    assert torch.equal(arena.k, k) and torch.equal(arena.v, v) and torch.equal(arena.length, length)


def ours_and_lerobot_style(model):
    """One chunk from the same prefix and noise: ours, the benchmark's baseline, its cache."""
    arena = model.new_arena(2, 256)
    slot = arena.allocate()
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 4))
    model.prefill(arena, slot, prefix)
    n = prefix.embeds.shape[0]
    noise = model.make_noise(3)
    ours = model.sample_actions(arena, slot, n, noise)
    cache = arena_to_dynamic_cache(arena, slot, n)
    return ours, sample_actions_hf_style(model.expert, cache, n, noise), cache, n


def test_lerobot_style_cloned_cache_gives_the_same_chunk(tiny_model):
    """The benchmark's baseline computes the same function (up to rounding)."""
    ours, theirs, cache, n = ours_and_lerobot_style(tiny_model)
    assert (ours - theirs).abs().max().item() < HF_STYLE_ATOL
    assert cache.get_seq_length() == n  # every step cloned it; the template never grew


def test_lerobot_style_baseline_runs_under_the_bf16_precision_policy():
    """pi05 on a GPU is bf16 with fp32 action projections and Euler state (model/precision.py):
    the benchmark's baseline must cast as the expert does (it crashed at `bench step --preset
    pi05 --device cuda`: fp32 activations into bf16 layers)."""
    model = build_model(get_preset("tiny"), "cpu", torch.bfloat16)
    assert model.expert.action_in_proj.weight.dtype == torch.float32
    assert model.expert.dtype == torch.bfloat16
    ours, theirs, _, _ = ours_and_lerobot_style(model)
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    assert (ours.float() - theirs).abs().max().item() < 0.1  # bf16 layers: rounding, not bugs
