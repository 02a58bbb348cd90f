"""Training-time real-time chunking (model/rtc_prefix.py, `rtc.guidance: prefix`): the
held rows are the previous chunk's actions in bytes, no held row is the plain loop in
bytes, and the held rows steer the rest of the chunk."""

import pytest
import torch

from embodied_kv.model.config import get_preset
from embodied_kv.model.rtc import guidance_weights, prefix_weights, sample_guided
from embodied_kv.model.rtc_prefix import row_modulation, sample_prefixed
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model, denoise_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.fixture(scope="module")
def rig():
    model = build_model(get_preset("tiny"))
    arena = model.new_arena(1, 256)
    slot = arena.allocate()
    model.prefill(arena, slot, model.embed_prefix(synthetic_observation(model.cfg, 3)))
    n = arena.slot_len(slot)
    h, a = model.cfg.action_horizon, model.cfg.action_dim
    g = torch.Generator().manual_seed(1)
    noise, target = torch.randn(h, a, generator=g), torch.randn(h, a, generator=g)
    return model, arena, slot, torch.tensor(n), denoise_rows(n, 256), noise, target


def test_no_held_row_is_the_plain_loop_in_bytes(rig):
    model, arena, slot, plen, rows, noise, target = rig
    h = model.cfg.action_horizon
    plain = model.expert.sample(arena, slot, plen, noise, rows)
    w = prefix_weights(h, 0, 2, "hard")  # d = 0: nothing held
    got = sample_prefixed(model.expert, arena, slot, plen, noise, target, w, rows)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("d", [1, 3])
def test_held_rows_are_the_previous_chunk_and_steer_the_rest(rig, d):
    model, arena, slot, plen, rows, noise, target = rig
    h = model.cfg.action_horizon
    w = prefix_weights(h, d, 2, "hard")
    got = sample_guided(model.expert, arena, slot, plen, noise, target, w, 5.0, "prefix", rows)
    assert torch.equal(got[:d], target[:d])
    plain = model.expert.sample(arena, slot, plen, noise, rows)
    assert (got[d:] - plain[d:]).abs().max() > 1e-4  # the free rows attend to the held ones
    other = target.clone()
    other[d:] += 10.0  # what the previous chunk holds beyond the prefix is never read
    again = sample_prefixed(model.expert, arena, slot, plen, noise, other, w, rows)
    assert torch.equal(again, got)


def test_row_modulation_takes_t0_on_held_rows_and_step_k_elsewhere(rig):
    model = rig[0]
    ex = model.expert
    mod = ex.modulation(torch.tensor([1.0, 0.5]))  # [N, 2, W]
    clean = ex.modulation(torch.zeros(1))
    held = (torch.arange(4) < 1)[:, None]
    got = row_modulation(held, clean, mod, 1)
    assert got.scale1.shape == (mod.scale1.shape[0], 1, 4, mod.scale1.shape[-1])
    assert torch.equal(got.shift[:, 0, 0], clean.shift[:, 0])
    assert all(torch.equal(got.gate[:, 0, i], mod.gate[:, 1]) for i in (1, 2, 3))


def test_the_band_after_the_held_rows_is_error_guided(rig):
    """0 < W < 1 after the held rows: each step's velocity there is v - g_k W (Y - (x - t v))
    (float64 reference over the same velocities); no g_k (beta 0) or the hard schedule: the
    held rows alone, in bytes. sample_guided hands its g_k to the prefixed loop."""
    model, arena, slot, plen, rows, noise, target = rig
    h, d, beta = model.cfg.action_horizon, 2, 5.0
    steps = model.expert.cfg.denoise_steps
    gs = guidance_weights([1.0 - k / steps for k in range(steps)], beta)
    hard = prefix_weights(h, d, 1, "hard")
    alone = sample_prefixed(model.expert, arena, slot, plen, noise, target, hard, rows)
    assert torch.equal(sample_prefixed(model.expert, arena, slot, plen, noise, target, hard,
                                       rows, gs=gs), alone)  # fmt: skip
    w = prefix_weights(h, d, 1, "exp", band=3)
    assert w[:d].eq(1).all() and (w[d : d + 3] > 0).all() and (w[d : d + 3] < 1).all()
    assert not w[d + 3 :].any()
    assert torch.equal(sample_prefixed(model.expert, arena, slot, plen, noise, target, w, rows),
                       alone)  # no g_k: no band  # fmt: skip
    got = sample_prefixed(model.expert, arena, slot, plen, noise, target, w, rows, gs=gs)
    guided = [sample_guided(model.expert, arena, slot, plen, noise, target, w, b, "prefix", rows)
              for b in (beta, 0.0)]  # fmt: skip
    assert torch.equal(guided[0], got) and torch.equal(guided[1], alone)
    # the reference: the same loop in float64 from the expert's velocities at each x
    calls = []
    velocity_at = model.expert.velocity_at

    def record(x, *args, **kw):
        v = velocity_at(x, *args, **kw)
        calls.append((x.double(), v.double()))
        return v

    model.expert.velocity_at = record
    try:
        again = sample_prefixed(model.expert, arena, slot, plen, noise, target, w, rows,
                                gs=gs)  # fmt: skip
    finally:
        del model.expert.velocity_at
    assert torch.equal(again, got)
    assert len(calls) == steps
    held = w[:, None].double() == 1
    band = torch.where(held, 0.0, w[:, None].double())
    y = target.double()
    for k, (x, v) in enumerate(calls):
        t = 1.0 - k / steps
        ref = x + (-1.0 / steps) * (v - gs[k] * band * (y - (x - t * v)))
        ref = torch.where(held, y, ref)
        nxt = calls[k + 1][0] if k + 1 < len(calls) else got.double()
        assert torch.allclose(nxt.reshape(ref.shape), ref, atol=1e-5, rtol=1e-5), k
    assert torch.equal(got[:d], target[:d])
    # the band is pulled towards the old chunk, the rows after it much less
    gap = (got - target).norm(dim=-1)
    free = (alone - target).norm(dim=-1)
    assert (gap[d : d + 3] < free[d : d + 3]).all()
