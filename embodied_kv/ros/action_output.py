"""The fixed-rate action output: a dedicated thread on an absolute-time schedule.

Control tick k is due at `clock.time_of(k)` (time.monotonic). The thread sleeps
until then, pops the action for tick k from the engine's ActionQueue (its own
lock, never the engine lock) and publishes it, so a long engine cycle never delays
an action: the engine only has to keep a chunk ahead of the output. A tick that
leaves late is still published (the stream keeps its count); after more than
MAX_LAG_TICKS behind, the schedule jumps to now and the skipped ticks are counted.
Why a thread, not an rclpy timer or an output process: docs/ros.md, "Real time".
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embodied_kv.ros.rate_probe import RateProbe
from embodied_kv.ros.thread_priority import set_thread_nice
from embodied_kv.ros.worker import Worker

MAX_LAG_TICKS = 5  # behind by more than this: drop the backlog instead of bursting it
STATS_WINDOW_S = 2.0  # /diagnostics rate and jitter are over the last this many seconds


class ControlClock:
    """Tick k of the control stream is due at t0 + k * period (time.monotonic, s).

    One clock per engine: the output thread publishes tick k at its time, and the
    engine stamps each chunk with the tick of its observation (the robot state's
    capture, else the cycle's start; ActionQueue: a chunk observed at tick t0 covers
    t0 .. t0+H-1)."""

    def __init__(self, rate_hz: float, t0: float | None = None):
        self.period_s = 1.0 / rate_hz
        self.t0 = time.monotonic() if t0 is None else t0
        self._wall_minus_mono = time.time() - time.monotonic()

    def time_of(self, tick: int) -> float:
        return self.t0 + tick * self.period_s

    def tick_at(self, t: float) -> int:
        return int((t - self.t0) // self.period_s)

    def now(self) -> int:
        return self.tick_at(time.monotonic())

    def tick_of_wall_ns(self, ns: int) -> int:
        """The tick a wall-clock (ROS system time) instant in ns falls in."""
        return self.tick_at(ns / 1e9 - self._wall_minus_mono)

    def wall_ns(self, tick: int) -> int:
        """Wall-clock (ROS system time) of tick `tick`, in ns, for message stamps."""
        return int((self.time_of(tick) + self._wall_minus_mono) * 1e9)


@dataclass
class OutputCounters:
    published: int = 0
    waiting: int = 0  # ticks before the first chunk since start (no observation yet)
    misses: int = 0  # later ticks with no fresh action: the last one was repeated
    late: int = 0  # published more than one period after their due time
    skipped: int = 0  # ticks dropped after falling MAX_LAG_TICKS behind
    errors: int = 0  # exceptions in pop / publish (logged, the stream went on)


class ActionOutput(Worker):
    """Publishes `pop(tick)`'s action at every tick from start() to stop()."""

    THREAD_NAME = "action-output"

    def __init__(
        self,
        clock: ControlClock,
        pop: Callable[[int], tuple[np.ndarray, bool]],
        publish: Callable[[np.ndarray, int], None],
        log_error: Callable[[str], None],
        nice: int = 0,
    ):
        super().__init__()
        self.clock, self._pop, self._publish, self._log_error = clock, pop, publish, log_error
        self.nice = nice  # asked for the thread (ros/thread_priority.py)
        self.nice_now: tuple[int, str] | None = None  # what it got, and why not if not
        self.counters = OutputCounters()
        self.publish_times = RateProbe(clock.period_s, keep=4096)
        self._lateness: deque[float] = deque(maxlen=1024)  # s past due, of the last ~20 s
        self._started = False  # a fresh action has left since start()

    def _on_start(self) -> None:
        self._started = False

    def _run(self) -> None:
        self.nice_now = set_thread_nice(self.nice)
        if self.nice_now[1]:
            self._log_error(f"action output: nice {self.nice} {self.nice_now[1]}; "
                            f"it runs at nice {self.nice_now[0]}")  # fmt: skip
        clock = self.clock
        tick = clock.now() + 1
        while True:
            delay = clock.time_of(tick) - time.monotonic()
            if self._stop.wait(max(delay, 0.0)):
                return
            try:
                action, fresh = self._pop(tick)
                self._publish(action, tick)
                now = time.monotonic()
            except Exception as e:  # a bad tick must not end the stream
                self.counters.errors += 1
                self._log_error(f"action output, tick {tick}: {type(e).__name__}: {e}")
                tick += 1
                continue
            c = self.counters
            c.published += 1
            self._started |= fresh
            c.misses += int(not fresh and self._started)
            c.waiting += int(not self._started)
            late = now - clock.time_of(tick)
            c.late += int(late > clock.period_s)
            self.publish_times.record(now)
            self._lateness.append(late)
            tick += 1
            behind = clock.tick_at(now) - tick
            if behind > MAX_LAG_TICKS:
                c.skipped += behind
                tick += behind

    def stats(self) -> dict[str, float]:
        """Rate and lateness over the last STATS_WINDOW_S, for /diagnostics."""
        since = time.monotonic() - STATS_WINDOW_S
        summary = self.publish_times.summary(since)
        lateness = np.array(self._lateness)  # deque -> array is atomic under the GIL
        return {
            "rate_hz": summary.rate_hz if summary else 0.0,
            "interval_p99_ms": summary.gap_p99_ms if summary else 0.0,
            "jitter_p99_ms": summary.jitter_p99_ms if summary else 0.0,
            "lateness_p99_ms": float(np.percentile(lateness, 99) * 1e3) if len(lateness) else 0.0,
            "lateness_max_ms": float(lateness.max() * 1e3) if len(lateness) else 0.0,  # ~20 s
            "output_nice": self.nice_now[0] if self.nice_now else self.nice,
            "output_nice_note": self.nice_now[1] if self.nice_now else "",
        }
