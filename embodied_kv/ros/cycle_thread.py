"""The engine's control cycle on its own thread, not in an rclpy callback.

Cycle n starts at control tick n * replan_every (ControlClock): it hands the latest
observation to the engine, runs `engine.cycle(tick)` (one prefill, the action chunk
into the queue, batched language decode until the cycle's deadline) and passes the
result to the nodes (chunk and text topics).

The chunk is stamped with the tick of its observation: the robot state's capture (its
`joint_states` header stamp), where the chunk's first action starts from. A state 40 ms
old at 50 Hz is two ticks the robot has already moved: the ActionQueue skips those
actions, and real-time chunking's d counts them (docs/rtc.md). A state with no stamp, a
stamp in the future or one older than the chunk can cover (H - replan_every ticks) is
stamped with the tick the cycle really started at, and counted.
A cycle that fails is undone by the engine, counted and logged here, and the next
one runs as usual; repeated failures put the engine in its safe state (engine/
faults.py), logged once as an ERROR and reported on /diagnostics.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from embodied_kv.engine.engine import Engine
from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.model.vla import Observation
from embodied_kv.ros.action_output import ControlClock
from embodied_kv.ros.worker import Worker

TOKENS_WINDOW = 30  # cycles over which tokens/s is reported


@dataclass
class CycleCounters:
    cycles: int = 0
    no_observation: int = 0  # cycle times skipped: no camera image received yet
    late_starts: int = 0  # cycles that started after their tick (the previous one overran)
    observation_age_ticks: int = 0  # the last cycle's: its tick - its observation's
    unstamped: int = 0  # cycles stamped at their start: the state had no usable stamp
    errors: int = 0  # exceptions in a cycle (logged; the next cycle runs as usual)
    tokens: int = 0  # language tokens decoded


class CycleThread(Worker):
    THREAD_NAME = "engine-cycle"
    STOP_TIMEOUT_S = 10.0  # after the cycle in progress: one period plus its overrun

    def __init__(
        self,
        engine: Engine,
        clock: ControlClock,
        observation: Callable[[], Observation | None],
        dispatch: Callable[[CycleResult, int], None],
        log_error: Callable[[str], None],
        observed_ns: Callable[[], int] = lambda: 0,
    ):
        super().__init__()
        self.engine, self.clock = engine, clock
        self.every = engine.cfg.replan_every
        self._observed_ns = observed_ns  # the observation's capture, wall-clock ns (0: none)
        self.max_age = max(0, engine.model.cfg.action_horizon - self.every)
        self._observation, self._dispatch, self._log_error = observation, dispatch, log_error
        self.counters = CycleCounters()
        self._recent: deque[tuple[float, int]] = deque(maxlen=TOKENS_WINDOW)  # (end s, tokens)

    def _run(self) -> None:
        clock, every = self.clock, self.every
        tick = (clock.now() // every + 1) * every
        while True:
            if self._stop.wait(max(clock.time_of(tick) - time.monotonic(), 0.0)):
                return
            start = max(tick, clock.now())
            self.counters.late_starts += int(start > tick)
            tick = start + every
            try:
                obs = self._observation()
                if obs is None:
                    self.counters.no_observation += 1
                    continue
                self._cycle(obs, self.observed_tick(start))
            except Exception as e:  # logged; the action output keeps going on the queue
                self.counters.errors += 1
                self._log_error(f"engine cycle at tick {start}: {type(e).__name__}: {e}")
                if self.engine.faults.safe:
                    self._log_error(f"engine in its safe state: {self.engine.faults.safe_reason}")

    def observed_tick(self, start: int) -> int:
        """The tick the observation was captured at, for a cycle starting at `start`."""
        ns = self._observed_ns()
        age = start - self.clock.tick_of_wall_ns(ns) if ns > 0 else -1
        if not 0 <= age <= self.max_age:  # none, from the future, or older than a chunk
            self.counters.unstamped += 1
            age = 0
        self.counters.observation_age_ticks = age
        return start - age

    def _cycle(self, obs: Observation, tick: int) -> None:
        engine = self.engine
        before = engine.manager.counters.tokens
        engine.observe(obs)
        result = engine.cycle(tick)
        if result is None:
            return
        if result.chunk is None:  # held or safe: only final events of dropped requests
            self._dispatch(result, tick)
            return
        tokens = max(0, engine.manager.counters.tokens - before)  # < 0 across a restore
        self.counters.cycles += 1
        self.counters.tokens += tokens
        self._recent.append((time.monotonic(), tokens))
        self._dispatch(result, tick)

    def tokens_per_s(self) -> float:
        recent = list(self._recent)
        if len(recent) < 2:
            return 0.0
        span = recent[-1][0] - recent[0][0]
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
