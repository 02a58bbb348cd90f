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
