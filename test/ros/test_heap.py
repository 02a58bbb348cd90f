"""No full garbage collection of the startup heap while the robot runs (issue 35, 3;
ros/heap.py): configure freezes what exists once the engine is built, so a full
collection (which stops every thread, the action output's too) only walks what came
after; cleanup of the last user thaws it again, so freeing the engine frees its cycles."""

from __future__ import annotations

import gc
import time

import pytest

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from embodied_kv.ros import heap  # noqa: E402
from embodied_kv.ros.kv_manager import KvManagerNode  # noqa: E402

PERIOD_MS = 20.0  # one action period at 50 Hz


def full_collection_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


def test_configure_freezes_the_startup_heap_and_cleanup_thaws_it(ros):
    owner = ros.participant()
    cpu = [Parameter("device", value="cpu")]
    node = owner.add(KvManagerNode(context=owner.context, namespace=ros.namespace,
                                   parameter_overrides=cpu))  # fmt: skip
    heap.thaw()
    unfrozen_ms = full_collection_ms()  # what one full collection costs without the freeze
    # counted after that collection: earlier tests' garbage is not part of the live heap
    before = len(gc.get_objects())  # this process's whole heap: torch, rclpy, pytest
    assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
    assert heap.frozen() >= before  # everything alive at configure, the engine included
    times = sorted(full_collection_ms() for _ in range(5))
    message = f"full collections after configure: {times} ms; before: {unfrozen_ms:.1f} ms"
    assert times[2] < PERIOD_MS and times[2] < unfrozen_ms, message
    print(f"\n{before} objects; {message}")
    assert heap.FULL.count >= 5 and heap.FULL in gc.callbacks  # watched for /diagnostics
    assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
    assert heap.frozen() == 0  # the last user freed the engine: nothing stays frozen
