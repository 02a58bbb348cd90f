"""Real-time chunking (RTC): the action expert's Euler loop guided towards the chunk the
robot is still executing (Black, Galliker, Levine 2025, "Real-Time Execution of Action
Chunking Flow Policies"; LeRobot policies/rtc/modeling_rtc.py).

While chunk k+1 is denoised the robot executes chunk k. The new chunk's first d actions
(d = inference delay in ticks) are executed from chunk k anyway: they are frozen to it
(W = 1); the following ones up to H - s are pulled towards it with decaying weights; the
rest is free:

    index i:   0 ........ d-1 | d ......... H-s-1 | H-s ...... H-1
    W_i:       1 (frozen)     | c_i (e^c_i - 1)/(e - 1)  | 0 (free)      c_i = (H-s-i)/(H-s-d+1)

Time conventions. The paper integrates tau = 0 (noise) -> 1 (data), A^tau = tau A + (1-tau) e,
v = dA/dtau. pi0.5 integrates t = 1 (noise) -> 0 (data), x_t = t e + (1-t) A, v_pi = e - A,
Euler steps dt = -1/n. So tau = 1 - t, v = -v_pi, and the one-step clean estimate
Ahat1 = A^tau + (1-tau) v is x_t - t v_pi. The paper's guided velocity (PiGDM, eq. 2-4)

    v_g = v + min(beta, (1-tau) / (tau r_tau^2)) (Y - Ahat1)^T diag(W) dAhat1/dA^tau,
    r_tau^2 = (1-tau)^2 / (tau^2 + (1-tau)^2)

becomes, in pi0.5's convention, v_pi - g (Y - Ahat1)^T diag(W) dAhat1/dx_t (`vjp`). LeRobot
0.6.1 computes the velocity before gradients are on, so its dAhat1/dx_t is the identity and
the correction is the weighted error alone (`error`: no backward pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embodied_kv.model.flow_constants import step_times
from embodied_kv.model.rtc_prefix import sample_prefixed
from embodied_kv.storage.arena import KVArena

SCHEDULES = ("exp", "linear", "hard")
GUIDANCE = ("vjp", "error", "prefix")  # prefix: model/rtc_prefix.py (training-time RTC)


@dataclass(frozen=True)
class RTCConfig:
    enabled: bool = False  # off: the plain Euler loop, byte for byte
    max_guidance: float = 5.0  # beta, the clip of the guidance weight (paper: 5; LeRobot
    # max_guidance_weight: 10)
    execution_horizon: int = 0  # s, ticks a chunk is executed before the next one lands (the
    # paper's s; LeRobot's execution_horizon is H - s); 0 = the engine's replan_every
    schedule: str = "exp"  # W over [d, H - s): exp (the paper) | linear | hard (0 after d)
    guidance: str = "vjp"  # vjp: PiGDM through the expert (the paper) | error: LeRobot's |
    # prefix: the d stale actions held clean, for weights trained with them (rtc_prefix.py)
    delay: int | str = "measured"  # d in ticks: "measured" (the queue's moving estimate of
    # observation -> chunk arrival) or a fixed int >= 0
    delay_ema: float = 0.5  # weight of the newest measured delay in the estimate
    band: int = 0  # rows of W's schedule after the d stale ones: W over [d, min(H - s,
    # d + band)); 0 = up to H - s (the paper's). With `prefix`: the error-guided rows after
    # the held ones (`hard`: none)

    def __post_init__(self):
        if not (math.isfinite(self.max_guidance) and self.max_guidance >= 0):
            raise ValueError(f"rtc.max_guidance={self.max_guidance} must be finite and >= 0")
        if isinstance(self.execution_horizon, bool) or self.execution_horizon < 0:
            raise ValueError(f"rtc.execution_horizon={self.execution_horizon} must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"rtc.schedule={self.schedule!r}: use one of {SCHEDULES}")
        if self.guidance not in GUIDANCE:
            raise ValueError(f"rtc.guidance={self.guidance!r}: use one of {GUIDANCE}")
        d = self.delay
        if d != "measured" and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"rtc.delay={d!r}: use 'measured' or an int >= 0 (ticks)")
        if not 0 < self.delay_ema <= 1:
            raise ValueError(f"rtc.delay_ema={self.delay_ema} must be in (0, 1]")
        if isinstance(self.band, bool) or not isinstance(self.band, int) or self.band < 0:
            raise ValueError(f"rtc.band={self.band!r} must be an int >= 0 (0: up to H - s)")


@dataclass(frozen=True)
class Guide:
    """What one guided chunk is pulled towards, on the model's device."""

    target: torch.Tensor  # [H, A] fp32 Y: the previous chunk from the new chunk's first tick,
    # normalised model units; rows it does not cover are zeros (W 0 there)
    weights: torch.Tensor  # [H] fp32 W
    delay: int  # d used for W (ticks)


def prefix_weights(horizon: int, delay: int, execution_horizon: int, schedule: str,
                   band: int = 0) -> torch.Tensor:  # fmt: skip
    """W [H] fp32 (paper eq. 5): 1 for i < d, the schedule over [d, H - s), 0 after;
    band > 0 ends the schedule at d + band if that comes first."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if horizon < 1 or delay < 0 or execution_horizon < 0:
        raise ValueError(f"horizon={horizon}, delay={delay}, s={execution_horizon}: bad values")
    w = torch.zeros(horizon, dtype=torch.float64)
    d = min(delay, horizon)
    w[:d] = 1.0
    end = horizon - execution_horizon
    if band:
        end = min(end, d + band)
    if schedule != "hard" and end > d:
        i = torch.arange(d, end, dtype=torch.float64)
        c = (end - i) / (end - d + 1)
        w[d:end] = c if schedule == "linear" else c * torch.expm1(c) / (math.e - 1)
    return w.float()


def guidance_weights(times: list[float], beta: float) -> list[float]:
    """g_k = min(beta, (1 - tau)/(tau r_tau^2)) at each step's tau = 1 - t_k (inf at
    tau = 0, the first step: beta). Host floats, fixed by the step count and beta."""
    out = []
    for t in times:
        tau = 1.0 - t
        if tau <= 0.0:
            out.append(beta)
            continue
        r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
        out.append(min(beta, (1 - tau) / (tau * r2)) if r2 > 0 else beta)
    return out


def guided_velocity(
    expert,
    x: torch.Tensor,
    ctx,
    k: int,
    t: torch.Tensor,
    arena: KVArena,
    slot: int,
    prefix_len,
    target: torch.Tensor,
    weights: torch.Tensor,
    g: float,
    guidance: str,
) -> torch.Tensor:
    """x [H, A] fp32 at step k (flow time t, a 0-d tensor) -> guided v_pi [H, A] fp32.

    `vjp`: autograd through the expert with the prefix KV fixed (arena rows are read, never
    a leaf); the expert's fused kernels fall back to their torch references while autograd
    records (kernels/triton_base.py use_kernel), so this also captures as a CUDA graph."""
    w = weights[:, None]  # [H, 1]
    if guidance == "vjp":
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            v = expert.velocity_at(xg, ctx, k, arena, slot, prefix_len).float()
            a1 = xg - t * v  # Ahat1 [H, A]
            err = (target - a1) * w
            (corr,) = torch.autograd.grad(a1, xg, err.detach())
        v = v.detach()
    else:
        v = expert.velocity_at(x, ctx, k, arena, slot, prefix_len).float()
        corr = (target - (x - t * v)) * w
    return v - g * corr


@torch.no_grad()
def sample_guided(
    expert,
    arena: KVArena,
    slot: int,
    prefix_len,
    noise: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor,
    beta: float,
    guidance: str,
    rows: int | None = None,
    layer_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """ActionExpert.sample with RTC guidance -> chunk [H, A] fp32. The same modulation,
    mask and update order, so beta = 0 gives its bytes. No host reads of device values
    (target and weights may be a graph's static buffers). `prefix`: the d stale rows held
    instead, the rows of W's schedule after them `error`-guided (rtc_prefix.py)."""
    steps = expert.cfg.denoise_steps
    dt = -1.0 / steps
    host_t = [1.0 + k * dt for k in range(steps)]  # the flow times in float64 on the host
    gs = guidance_weights(host_t, beta)
    if guidance == "prefix":
        return sample_prefixed(expert, arena, slot, prefix_len, noise, target, weights, rows,
                               layer_rows, gs if beta > 0 else None)  # fmt: skip
    x = noise.float()
    times = step_times(steps, x.device)
    mod = expert.flow_modulation(steps, x.device)  # that of `times`, kept across actions
    ctx = expert.context(None, x.shape[0], prefix_len, rows, x.device, layer_rows, mod)
    for k in range(steps):
        v = guided_velocity(expert, x, ctx, k, times[k], arena, slot, prefix_len, target,
                            weights, gs[k], guidance)  # fmt: skip
        x = x + dt * v
    return x
