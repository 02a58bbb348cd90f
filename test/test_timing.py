import time

import pytest
import torch

from embodied_kv.timing import device_clock, elapsed_ms, synchronize


def test_cpu_clock_is_perf_counter():
    assert device_clock("cpu") is time.perf_counter
    synchronize("cpu")


def test_elapsed_ms_measures_the_clock():
    ticks = iter([1.0, 1.25])
    clock = lambda: next(ticks)  # noqa: E731
    assert elapsed_ms(clock(), clock) == pytest.approx(250.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_clock_waits_for_queued_work():
    clock = device_clock("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    t = clock()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    assert elapsed_ms(t, clock) > 1.0  # 20 4k GEMMs take well over a millisecond once waited for


def test_cpu_thread_clock_excludes_sleep():
    """The thread clock counts this thread's CPU work, not time the OS gives others."""
    clock = device_clock("cpu", "thread")
    t = clock()
    time.sleep(0.05)
    assert elapsed_ms(t, clock) < 25
    with pytest.raises(ValueError, match="cpu clock"):
        device_clock("cpu", "cycles")
