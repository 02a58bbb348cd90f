"""A closed loop under an injected inference delay: the world's episodes executed tick by
tick while each chunk is computed d ticks late (`bench rtc` measures real-time chunking on
it; `eval visited --delays` collects the states it reaches, for DAgger).

Timeline of one episode (ticks; a cycle every p = max(replan_every, d) ticks):

    t0: observe ──┬── d ticks executed from the old chunk ──┬── new chunk lands (t0 + d)
                  │   (inference running)                   │   executed until t0 + p
    the chunk covers t0 .. t0+H-1; its first d actions are stale when it lands

The first chunk of an episode lands at once (the robot waits for it). A tick no chunk
covers repeats the last action (at d = 8 with `world`'s H = 10: ticks t0+10 .. t0+15).

Executors (what the robot executes each tick, given the chunks that landed):
    naive     the engine's ActionQueue, blend 0: switch to the new chunk where it lands
    ensemble  ACT's temporal ensembling: every landed chunk covering the tick, averaged with
              weights exp(-m i), i = 0 the oldest (ACT: m = 0.01)
    rtc-vjp   the queue, chunks guided by RTC (model/rtc.py), d measured by the queue
    rtc-error the same with LeRobot's guidance (no backward pass)
    rtc-prefix  the d stale actions held clean (training-time RTC, model/rtc_prefix.py): for
              weights trained with `train --prefix-max`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.eval.runners import world_observation
from embodied_kv.model.rtc import RTCConfig
from embodied_kv.world.scene import REAL_ACTION_DIMS
from embodied_kv.world.tasks import episode

REPLAN = 5  # ticks per cycle without delay (EngineConfig.replan_every, eval world's)
TICKS = 60  # per episode: eval world's 12 cycles x 5 actions
MOTION_DIMS = 3  # x, y, z: the arm's position targets (Scene.step reads these and the
# gripper, whose open/close command is a step of 2 by design and is left out of the jumps)
ENSEMBLE_M = 0.01  # ACT temporal_ensemble_coeff
# rtc-prefix-band: rows error-guided after the held ones (measured on world_smooth: the
# full band [d, H - s) holds the old plan too long and costs success, docs/rtc.md)
PREFIX_BAND = 10


@dataclass
class Trace:
    executed: list[np.ndarray] = field(default_factory=list)  # [REAL_ACTION_DIMS] per tick
    jumps: list[float] = field(default_factory=list)  # at switches
    lead_gaps: list[float] = field(default_factory=list)  # per chunk: the d stale actions
    switch_gaps: list[float] = field(default_factory=list)  # new vs old chunk at the switch
    steps: list[float] = field(default_factory=list)  # |a_t - a_{t-1}| at every other tick
    success: bool = False

    @property
    def actions(self) -> list[np.ndarray]:
        """The executed position targets [MOTION_DIMS] per tick (what the jumps measure)."""
        return [a[:MOTION_DIMS] for a in self.executed]


class Executor:
    """What the robot executes each tick, given the chunks that have landed."""

    name = ""
    rtc: RTCConfig = RTCConfig()

    def reset(self, engine: Engine) -> None:
        self.engine = engine

    def landed(self, chunk: np.ndarray, start: int) -> None:  # noqa: B027 (optional hook)
        pass

    def action(self, tick: int) -> np.ndarray:
        return self.engine.queue.pop(tick)[0]


class Naive(Executor):
    name = "naive"


class Guided(Executor):
    def __init__(self, guidance: str, execution_horizon: int = 0, name: str = "", **rtc):
        """`rtc`: further RTCConfig fields (schedule, max_guidance, delay, band)."""
        self.name = name or f"rtc-{guidance}"
        self.rtc = RTCConfig(enabled=True, guidance=guidance, execution_horizon=execution_horizon,
                             **rtc)  # fmt: skip


class Ensemble(Executor):
    name = "ensemble"

    def reset(self, engine: Engine) -> None:
        super().reset(engine)
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.last = np.zeros(engine.robot.action_dim)

    def landed(self, chunk: np.ndarray, start: int) -> None:
        self.chunks.append((start, np.asarray(chunk, np.float64)))

    def action(self, tick: int) -> np.ndarray:
        self.engine.queue.pop(tick)  # the queue's own bookkeeping (delay), unused
        rows = [c[tick - s] for s, c in self.chunks if 0 <= tick - s < len(c)]
        if rows:
            w = np.exp(-ENSEMBLE_M * np.arange(len(rows)))  # oldest first, weighted most
            self.last = (w[:, None] * np.stack(rows)).sum(0) / w.sum()
        return self.last.copy()


def methods(execution_horizon: int = 0, prefix_band: int = PREFIX_BAND, **rtc) -> list[Executor]:
    """Every executor; `execution_horizon` and `rtc` (RTCConfig fields) set the guided ones.
    rtc-prefix holds the d stale actions alone (the hard schedule); rtc-prefix-band also
    error-guides the `prefix_band` rows after them (rtc's schedule and beta)."""
    held = {**rtc, "schedule": "hard"}
    banded = {**rtc, "band": prefix_band}
    return [Naive(), Ensemble(), Guided("vjp", execution_horizon, **rtc),
            Guided("error", execution_horizon, **rtc),
            Guided("prefix", execution_horizon, **held),
            Guided("prefix", execution_horizon, "rtc-prefix-band", **banded)]  # fmt: skip


EXECUTORS = tuple(ex.name for ex in methods())


def executor(name: str, execution_horizon: int = 0) -> Executor:
    """One of EXECUTORS by name (ValueError otherwise)."""
    for ex in methods(execution_horizon):
        if ex.name == name:
            return ex
    raise ValueError(f"executor {name!r}: one of {EXECUTORS}")


def make_engine(model, rtc: RTCConfig) -> Engine:
    cfg = EngineConfig(
        preset=model.cfg.name, control_hz=1e-3, replan_every=REPLAN, blend=0, history=0,
        narrate_every=0, auto_episode_capsule=False, cuda_graphs=False, num_slots=2, rtc=rtc,
    )  # fmt: skip
    return Engine(cfg, model=model)


def run_episode(engine: Engine, ex: Executor, seed: int, delay: int, ticks: int = TICKS,
                visit: Callable[[np.ndarray], None] | None = None) -> Trace:  # fmt: skip
    """World episode `seed` (tasks.episode) executed by `ex` under an injected delay of
    `delay` ticks, for at most `ticks` ticks. `visit(executed)` is called at each cycle's
    observation after the first with the actions executed so far ([n, REAL_ACTION_DIMS]:
    the state the policy is about to see, as world/visited.py stores it)."""
    scene, task = episode(seed)
    engine.begin_episode()
    ex.reset(engine)
    size = engine.model.cfg.vision.image_size
    period = max(REPLAN, delay)
    trace, tick, first = Trace(), 0, True
    switch_tick = None  # the first tick executed from the newest chunk (at d = p: next cycle's)
    prev, prev_start = np.zeros((0, MOTION_DIMS)), 0  # the last chunk that landed
    old_chunk, old_start = prev, 0  # the one before it

    def execute(k: int) -> bool:
        nonlocal switch_tick
        a = np.asarray(ex.action(k), np.float64)
        if trace.executed:
            step = float(np.linalg.norm(a[:MOTION_DIMS] - trace.executed[-1][:MOTION_DIMS]))
            (trace.jumps if k == switch_tick else trace.steps).append(step)
        if k == switch_tick:  # what is executed against what the old chunk had for this tick
            if len(old_chunk) > k - old_start:
                old_a = old_chunk[k - old_start, :MOTION_DIMS]
                trace.switch_gaps.append(float(np.linalg.norm(a[:MOTION_DIMS] - old_a)))
            switch_tick = None
        trace.executed.append(a[:REAL_ACTION_DIMS].copy())
        scene.step(a)
        return task.success(scene)

    while tick < ticks:
        t0 = tick
        if visit is not None and not first:
            visit(np.array(trace.executed).reshape(-1, REAL_ACTION_DIMS))
        engine.observe(world_observation(scene, task.instruction, size))
        lag = 0 if first else delay
        for k in range(t0, min(t0 + lag, ticks)):  # inference running: the old chunk
            if execute(k):
                trace.success = True
                return trace
        if t0 + lag >= ticks:
            break
        result = engine.cycle(t0)
        ex.landed(result.chunk, t0)
        if not first:
            switch_tick = t0 + lag
            lead = min(lag, len(prev) - (t0 - prev_start))  # stale actions both chunks hold
            if lead > 0:
                old = prev[t0 - prev_start : t0 - prev_start + lead, :MOTION_DIMS]
                gaps = np.linalg.norm(result.chunk[:lead, :MOTION_DIMS] - old, axis=1)
                trace.lead_gaps.append(float(gaps.max()))
        old_chunk, old_start = prev, prev_start
        prev, prev_start = np.asarray(result.chunk, np.float64), t0
        for k in range(t0 + lag, min(t0 + period, ticks)):
            if execute(k):
                trace.success = True
                return trace
        tick, first = t0 + period, False
    return trace
