"""Real-time chunking in the action expert's sampler (model/rtc.py): the guided velocity
against a float64 reference written from the paper's formula in the paper's convention
(tau = 0 noise -> 1 data), beta = 0 as plain denoising in bytes, the hard schedule's frozen
prefix, the weights of eq. 5."""

import math

import pytest
import torch

from embodied_kv.model.config import get_preset
from embodied_kv.model.rtc import (
    RTCConfig,
    guidance_weights,
    guided_velocity,
    prefix_weights,
    sample_guided,
    step_times,
)
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model, denoise_rows

# fp32 implementation vs the float64 reference on the same weights: the reference model
# keeps the precision policy's fp32 norms and modulation, so fp32 rounding (~1e-7 relative)
# passes through a Jacobian whose entries reach ~10 and a guidance weight up to beta = 5
REF_ATOL = 2e-4
REF_RTOL = 1e-4
# hard schedule, beta 5, 10 Euler steps: the frozen actions' largest gap to the previous
# chunk, as a share of the unguided chunk's gap (guidance is soft: no exact inpainting)
HARD_EPS = {"vjp": 0.12, "error": 0.12}  # measured: vjp <= 0.095, error <= 0.063


pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.fixture(scope="module")
def models():
    cfg = get_preset("tiny")
    m32 = build_model(cfg)
    m64 = build_model(cfg, dtype=torch.float64)
    state = {k: v.double() if v.is_floating_point() else v for k, v in m32.state_dict().items()}
    m64.load_state_dict(state, strict=False)  # the fp32 policy's parameters stay fp32
    return m32, m64


def prefilled(model, obs=3):
    arena = model.new_arena(2, 256)
    slot = arena.allocate()
    model.prefill(arena, slot, model.embed_prefix(synthetic_observation(model.cfg, obs)))
    return arena, slot


def paper_guided_velocity(v_paper, a, tau, y, w, beta, guidance):
    """The paper's eq. 2-4 in float64, tau = 0 noise -> 1 data: v + min(beta, (1 - tau) /
    (tau r^2)) (Y - Ahat1)^T diag(W) dAhat1/dA, Ahat1 = A + (1 - tau) v(A), the Jacobian in
    full (not a VJP). `error`: LeRobot's correction, dAhat1/dA taken as the identity."""

    def ahat1(x):
        return x + (1 - tau) * v_paper(x)

    e = (y - ahat1(a)) * w[:, None]  # [H, A]
    if guidance == "vjp":
        jac = torch.autograd.functional.jacobian(ahat1, a)  # [H, A, H, A]
        corr = torch.einsum("ij,ijkl->kl", e, jac)
    else:
        corr = e
    r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
    g = beta if tau == 0 else min(beta, (1 - tau) / (tau * r2))
    return v_paper(a) + g * corr


@pytest.mark.parametrize("guidance", ["vjp", "error"])
def test_guided_velocity_equals_the_papers_formula_in_float64(models, guidance):
    m32, m64 = models
    cfg = m32.cfg
    h, a_dim, steps = cfg.action_horizon, cfg.action_dim, cfg.denoise_steps
    (a32, s32), (a64, s64) = prefilled(m32), prefilled(m64)
    n = a32.slot_len(s32)
    plen = torch.tensor(n)
    times = step_times(steps, "cpu")
    ctx32 = m32.expert.context(times, h, plen, None, "cpu")
    ctx64 = m64.expert.context(times, h, plen, None, "cpu")
    g = torch.Generator().manual_seed(5)
    y = torch.randn(h, a_dim, generator=g)
    w = prefix_weights(h, 3, 4, "exp")
    beta = 5.0
    gs = guidance_weights([1.0 - k / steps for k in range(steps)], beta)
    for k in (0, 3, 9):  # tau 0 (the clip), a middle step, the last
        x = torch.randn(h, a_dim, generator=g)
        got = guided_velocity(m32.expert, x, ctx32, k, times[k], a32, s32, plen, y, w, gs[k],
                              guidance)  # fmt: skip

        def v_paper(xx, k=k):  # dA/dtau = -(e - A) of pi0.5's velocity
            return -m64.expert.velocity_at(xx, ctx64, k, a64, s64, plen).double()

        tau = 1.0 - float(times[k].double())
        want = -paper_guided_velocity(
            v_paper, x.double(), tau, y.double(), w.double(), beta, guidance
        )  # back to pi0.5's v = dx/dt
        torch.testing.assert_close(got.double(), want, atol=REF_ATOL, rtol=REF_RTOL)
        # the tolerance is far below the guidance term itself: a wrong sign or weight fails
        guidance_term = (want + v_paper(x.double())).abs().max()
        assert (got.double() - want).abs().max() < 0.05 * guidance_term


@pytest.mark.parametrize("guidance", ["vjp", "error"])
def test_beta_zero_is_plain_denoising_in_bytes(models, guidance):
    m = models[0]
    arena, slot = prefilled(m)
    n = arena.slot_len(slot)
    h, a_dim = m.cfg.action_horizon, m.cfg.action_dim
    y = torch.randn(h, a_dim, generator=torch.Generator().manual_seed(1))
    w = prefix_weights(h, 4, 3, "exp")
    for seed in (0, 1):
        noise = m.make_noise(seed)
        plain = m.sample_actions(arena, slot, n, noise)
        rows = denoise_rows(n, arena.spec.max_len)
        got = sample_guided(m.expert, arena, slot, torch.tensor(n), noise, y, w, 0.0, guidance,
                            rows)  # fmt: skip
        assert torch.equal(got, plain)
        guided = sample_guided(m.expert, arena, slot, torch.tensor(n), noise, y, w, 5.0,
                               guidance, rows)  # fmt: skip
        assert not torch.equal(guided, plain)


@pytest.mark.parametrize("guidance", ["vjp", "error"])
def test_hard_schedule_freezes_the_first_d_actions_to_the_previous_chunk(models, guidance):
    m = models[0]
    arena, slot = prefilled(m)
    n = arena.slot_len(slot)
    h, a_dim = m.cfg.action_horizon, m.cfg.action_dim
    rows = denoise_rows(n, arena.spec.max_len)
    for d, seed in ((2, 0), (4, 1), (6, 2)):
        prev = m.sample_actions(arena, slot, n, m.make_noise(100 + seed))  # a chunk it could make
        noise = m.make_noise(seed)
        plain = m.sample_actions(arena, slot, n, noise)
        w = prefix_weights(h, d, 0, "hard")
        assert torch.equal(w, torch.tensor([1.0] * d + [0.0] * (h - d)))
        got = sample_guided(m.expert, arena, slot, torch.tensor(n), noise, prev, w, 5.0,
                            guidance, rows)  # fmt: skip
        gap = (got[:d] - prev[:d]).abs().max()
        naive = (plain[:d] - prev[:d]).abs().max()
        assert gap <= HARD_EPS[guidance] * naive, (d, float(gap), float(naive))
        assert a_dim == got.shape[1]


def test_prefix_weights_follow_eq_5():
    h, d, s = 10, 2, 3
    w = prefix_weights(h, d, s, "exp").double()
    end = h - s
    for i in range(h):
        if i < d:
            want = 1.0
        elif i < end:
            c = (end - i) / (end - d + 1)
            want = c * (math.exp(c) - 1) / (math.e - 1)
        else:
            want = 0.0
        assert abs(float(w[i]) - want) < 1e-7
    lin = prefix_weights(h, d, s, "linear")
    want_lin = torch.tensor([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6], dtype=torch.float64)
    assert torch.allclose(lin[d:end].double(), want_lin)
    assert torch.equal(prefix_weights(h, 20, 0, "exp"), torch.ones(h))  # d past the chunk


def test_guidance_weight_clips_at_beta_and_matches_the_formula():
    gs = guidance_weights([1.0, 0.5, 0.1], 5.0)
    assert gs[0] == 5.0  # tau = 0: infinite, clipped
    assert abs(gs[1] - 2.0) < 1e-12  # tau 0.5: (0.25 + 0.25) / 0.25
    assert gs[2] == 5.0  # tau 0.9: 9.11 > beta
    assert abs(guidance_weights([0.1], 100.0)[0] - 0.82 / 0.09) < 1e-9


@pytest.mark.parametrize(
    "kwargs",
    [{"max_guidance": -1.0}, {"max_guidance": float("inf")}, {"schedule": "cosine"},
     {"guidance": "grad"}, {"delay": -1}, {"delay": "auto"}, {"delay": True},
     {"execution_horizon": -2}, {"delay_ema": 0.0}],
)  # fmt: skip
def test_config_refuses_bad_values(kwargs):
    with pytest.raises(ValueError, match="rtc"):
        RTCConfig(**kwargs)
    assert RTCConfig().enabled is False and RTCConfig(delay=3).delay == 3
