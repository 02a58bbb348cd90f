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


def device_clock(device: str | torch.device) -> Callable[[], float]:
    """A `perf_counter`-like clock (seconds) that synchronizes `device` before reading."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def elapsed_ms(start: float, clock: Callable[[], float]) -> float:
    """Milliseconds since `start`, read on `clock` (one of `device_clock`'s)."""
    return 1e3 * (clock() - start)
