"""Rate and jitter of a periodic stream, from its arrival (or publish) times.

Used by the subscribers that measure the action stream (tests, `make demo`) and by
the output thread for /diagnostics. Jitter is |inter-arrival - period|.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RateSummary:
    count: int  # arrivals in the window
    seconds: float  # first to last arrival
    rate_hz: float  # (count - 1) / seconds
    gap_p50_ms: float  # inter-arrival percentiles
    gap_p99_ms: float
    gap_max_ms: float
    jitter_p50_ms: float  # |gap - period| percentiles
    jitter_p99_ms: float

    def line(self, target_hz: float) -> str:
        return (
            f"{self.count} in {self.seconds:.1f} s = {self.rate_hz:.2f} Hz "
            f"(target {target_hz:g}); inter-arrival p50 {self.gap_p50_ms:.1f} ms, "
            f"p99 {self.gap_p99_ms:.1f} ms, max {self.gap_max_ms:.1f} ms; "
            f"jitter p50 {self.jitter_p50_ms:.2f} ms, p99 {self.jitter_p99_ms:.2f} ms"
        )


def summarize(times: np.ndarray, period_s: float) -> RateSummary | None:
    """Summary of arrival times (s, increasing); None with fewer than 3."""
    if len(times) < 3:
        return None
    gaps = np.diff(times) * 1e3
    jitter = np.abs(gaps - period_s * 1e3)
    span = float(times[-1] - times[0])
    return RateSummary(
        len(times),
        span,
        (len(times) - 1) / span if span > 0 else 0.0,
        float(np.percentile(gaps, 50)),
        float(np.percentile(gaps, 99)),
        float(gaps.max()),
        float(np.percentile(jitter, 50)),
        float(np.percentile(jitter, 99)),
    )


class RateProbe:
    """Thread-safe record of arrival times (time.monotonic), the last `keep` of them."""

    def __init__(self, period_s: float, keep: int = 1 << 16):
        self.period_s = period_s
        self._times: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, t: float | None = None) -> None:
        with self._lock:
            self._times.append(time.monotonic() if t is None else t)

    def times(self, since: float = float("-inf"), until: float = float("inf")) -> np.ndarray:
        with self._lock:
            return np.array([t for t in self._times if since <= t <= until])

    def count(self, since: float = float("-inf")) -> int:
        return len(self.times(since))

    def summary(self, since: float = float("-inf"), until: float = float("inf")):
        return summarize(self.times(since, until), self.period_s)

    def last(self) -> float | None:
        with self._lock:
            return self._times[-1] if self._times else None
