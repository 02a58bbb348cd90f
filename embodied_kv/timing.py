"""Wall-clock timing that means the same thing on CPU and CUDA.

CUDA work is queued asynchronously, so `time.perf_counter()` around a launch measures the
launch, not the work. Every timed region of the package (the frame loop, the isolated
baseline, capsules, benchmarks) reads its clock through here: on a CUDA device the clock
waits for the device's queued work first, on a CPU it is `time.perf_counter` itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# CPU clocks: wall time, or the calling thread's CPU time, which excludes the time the OS
# gives other processes (on a shared, oversubscribed CPU a preemption is otherwise the
# measurement). Thread time counts single-threaded work only (torch at one intra-op thread).
CPU_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def device_clock(device: str | torch.device, cpu: str = "wall") -> Callable[[], float]:
    """A `perf_counter`-like clock (seconds) that synchronizes `device` before reading;
    on a CPU, `cpu` picks one of CPU_CLOCKS."""
    device = torch.device(device)
    if device.type != "cuda":
        if cpu not in CPU_CLOCKS:
            raise ValueError(f"cpu clock {cpu!r} is none of {sorted(CPU_CLOCKS)}")
        return CPU_CLOCKS[cpu]

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def elapsed_ms(start: float, clock: Callable[[], float]) -> float:
    """Milliseconds since `start`, read on `clock` (one of `device_clock`'s)."""
    return 1e3 * (clock() - start)


class Stopwatch:
    """Times from a region's start to points inside it without waiting for the device at
    those points: on CUDA each point is an event recorded on the current stream (the host
    runs on and queues the next work), read once the caller has waited for the region's
    results anyway; on a CPU a point is `clock()` itself (its work is done when the call
    returns). engine/frame_loop.py: prefill -> denoise with no synchronize between them."""

    def __init__(self, device: str | torch.device, clock: Callable[[], float]):
        self.cuda = torch.device(device).type == "cuda"
        self.clock = clock
        self._t0 = 0.0
        self._e0 = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self._points: list = []  # CUDA events, kept for reuse

    def start(self) -> float:
        """The region starts now -> its host time on `clock` (which, on CUDA, waits for the
        device: call it where nothing is queued, at a cycle's boundary)."""
        self._t0 = self.clock()
        if self.cuda:
            self._e0.record()
        self._used = 0
        return self._t0

    def mark(self):
        """A point after the work queued so far; no wait on CUDA."""
        if not self.cuda:
            return self.clock()
        if self._used == len(self._points):
            self._points.append(torch.cuda.Event(enable_timing=True))
        event = self._points[self._used]
        self._used += 1
        event.record()
        return event

    def seconds(self, point) -> float:
        """Start -> `point` in seconds; on CUDA only once the device has done the work
        queued before it (after a host read of a later result, or a `clock()` call)."""
        if not self.cuda:
            return point - self._t0
        return self._e0.elapsed_time(point) / 1e3
