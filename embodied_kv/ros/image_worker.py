"""Camera frames are converted on a thread of their own, never in an executor callback.

Decoding a jpeg and resizing a large frame takes milliseconds to tens of milliseconds
of CPU; in the SingleThreadedExecutor that would delay every other callback (services,
joint states). The prefill node's callback checks the header (cheap: the size limits)
and hands the message here; this worker converts it and delivers the [3, S, S] tensor.

The queue is bounded by design: one pending frame per camera, and a newer frame of
the same camera replaces the one still waiting (counted in `replaced`), so a camera
faster than the converter costs neither memory nor latency.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from embodied_kv.ros.worker import Worker

WAIT_S = 0.05  # how often an idle worker looks at its stop flag


class ImageConverter(Worker):
    THREAD_NAME = "image-converter"

    def __init__(
        self,
        convert: Callable[[Any], torch.Tensor],
        deliver: Callable[[int, torch.Tensor], None],
        reject: Callable[[str, str], None],
    ) -> None:
        super().__init__()
        self._convert, self._deliver, self._reject = convert, deliver, reject
        self._pending: dict[int, tuple[str, Any]] = {}  # camera index -> (name, message)
        self._cond = threading.Condition()
        self.replaced = 0  # frames dropped for a newer one of the same camera
        self.converted = 0

    def submit(self, index: int, name: str, msg) -> None:
        with self._cond:
            if index in self._pending:
                self.replaced += 1
            self._pending[index] = (name, msg)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def stop(self, timeout: float | None = None) -> None:
        with self._cond:
            self._pending.clear()
            self._cond.notify()
        super().stop(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._pending:
                    self._cond.wait(WAIT_S)
                    continue
                index = next(iter(self._pending))  # the camera that waited longest
                name, msg = self._pending.pop(index)
            self._one(index, name, msg)

    def _one(self, index: int, name: str, msg) -> None:
        try:
            image = self._convert(msg)
        except ValueError as e:
            self._reject("image", f"camera {name}: {e}; frame skipped")
            return
        except Exception as e:  # a converter bug must not end the thread
            self._reject("image", f"camera {name}: {type(e).__name__}: {e}; frame skipped")
            return
        self.converted += 1
        self._deliver(index, image)
