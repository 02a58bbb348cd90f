"""The robot process's heap and Python's cyclic garbage collector (issue 35, 3).

A full (generation 2) collection holds the GIL while it traverses every tracked object,
so it stops every Python thread of the process, the action output's included. After
configure the robot's heap holds ~375k objects (torch, rclpy, the model and its
tokenizer): one full collection took 340 ms on the 2-core VM (loaded), the size of the
329 ms action gap the issue measured while clients hammered `reset` (objects the services
churn bring the next full collection sooner). Objects that exist once the engine is
built live as long as it does, so they go to the permanent generation (`gc.freeze`):
later full collections traverse only what came after (measured: under 1 ms). Before the
engine is freed they are made collectable again, so freeing it still frees its cycles.
"""

from __future__ import annotations

import gc
import time


class FullCollections:
    """Count and longest duration of the full collections while the heap is frozen
    (/diagnostics)."""

    def __init__(self) -> None:
        self.count = 0
        self.max_ms = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2 or not _frozen:  # not the deliberate ones of
            return  # a configure or a cleanup: only those while the robot runs
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.count += 1
        self.max_ms = max(self.max_ms, (time.perf_counter() - self._start) * 1e3)


FULL = FullCollections()
_frozen = 0


def settle(collect: bool) -> None:
    """After a configure: collect first (`collect`: once, when the engine was just built,
    so no startup garbage is kept for good), then freeze what is alive. From then on the
    full collections are watched (FULL)."""
    global _frozen
    if collect:
        gc.collect()
    gc.freeze()
    _frozen = gc.get_freeze_count()  # walks the whole list (O(n), GIL held): once, here
    if FULL not in gc.callbacks:
        FULL.count, FULL.max_ms = 0, 0.0
        gc.callbacks.append(FULL)


def thaw() -> None:
    """Before the engine may be freed: every object is collectable again."""
    global _frozen
    gc.unfreeze()
    _frozen = 0


def frozen() -> int:
    """Objects frozen by the last settle() (not gc.get_freeze_count(): that walks them)."""
    return _frozen
