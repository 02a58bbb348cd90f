"""The action output thread's nice value (ros/thread_priority.py): set per thread, on a
real thread, read back from the kernel."""

import os
import threading

import pytest

from embodied_kv.ros.thread_priority import set_thread_nice


def _in_thread(nice: int) -> tuple[tuple[int, str], int, int]:
    """-> (set_thread_nice's answer, the thread's nice read back, the main thread's)."""
    out = {}

    def run():
        out["answer"] = set_thread_nice(nice)
        out["read"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["answer"], out["read"], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_higher_nice_is_always_permitted_and_only_for_that_thread():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    answer, read, main = _in_thread(min(before + 3, 19))
    assert answer == (min(before + 3, 19), "") and read == answer[0]
    assert main == before  # per thread on Linux: the process keeps its own


def test_a_lower_nice_is_applied_with_the_privilege_else_reported():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    (now, why), read, main = _in_thread(before - 5)
    assert read == now and main == before
    if os.geteuid() == 0:
        assert (now, why) == (before - 5, "")
    else:  # without CAP_SYS_NICE: unchanged, and the reason says so
        assert now == before and why.startswith("not permitted")


@pytest.mark.parametrize("nice", [-21, 20])
def test_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=str(nice)):
        set_thread_nice(nice)
