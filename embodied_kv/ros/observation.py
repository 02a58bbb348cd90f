"""The latest inputs of the robot, assembled into one Observation per engine cycle.

The prefill node's callbacks write here (already converted: a camera image is a
[3, S, S] tensor by then); the cycle thread reads one Observation at the start of
each cycle and hands it to `engine.observe`. Nothing here waits on the engine.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from embodied_kv.model.vla import Observation


class ObservationBuffer:
    def __init__(self, num_cameras: int, image_size: int, state_dim: int, used_cameras: int):
        if used_cameras > num_cameras:
            raise ValueError(
                f"{used_cameras} cameras configured, the model takes at most {num_cameras}"
            )
        self.num_cameras, self.image_size, self.state_dim = num_cameras, image_size, state_dim
        self._images: list[torch.Tensor | None] = [None] * num_cameras  # [3, S, S] each
        self._state = np.zeros(state_dim)
        self._state_ns = 0  # the state's capture (its header stamp, wall-clock ns); 0: none
        self._instruction = ""
        self._instruction_ns = 0  # when the current instruction arrived (ns, the stamps' clock)
        self._lock = threading.Lock()

    def set_image(self, camera: int, image: torch.Tensor) -> None:
        assert image.shape == (3, self.image_size, self.image_size), image.shape
        with self._lock:
            self._images[camera] = image

    def set_state(self, state: np.ndarray, stamp_ns: int = 0) -> None:
        """The robot state and when it was captured (header stamp, ns; 0: unstamped)."""
        with self._lock:
            self._state = np.asarray(state, dtype=np.float64)[: self.state_dim].copy()
            self._state_ns = int(stamp_ns)

    def state_stamp_ns(self) -> int:
        """When the latest state was captured (wall-clock ns), 0 if unstamped or none yet:
        the tick the cycle thread stamps the chunk with (the chunk starts from this state)."""
        with self._lock:
            return self._state_ns

    def set_instruction(self, text: str, now_ns: int = 0) -> None:
        """The task; `now_ns` its arrival on the clock of the state's header stamps (0:
        unknown). A state stamped before a new instruction arrived shows the scene before the
        task was given: the observation says so (`after_instruction`)."""
        with self._lock:
            if text != self._instruction:
                self._instruction_ns = int(now_ns)
            self._instruction = text

    def observation(self) -> Observation | None:
        """None until some camera has sent a frame; cameras without one are masked."""
        with self._lock:
            present = tuple(img is not None for img in self._images)
            if not any(present):
                return None
            s = self.image_size
            images = torch.stack(
                [img if img is not None else torch.zeros(3, s, s) for img in self._images]
            )  # [num_cameras, 3, S, S]
            mask = None if all(present) else present
            stale = 0 < self._state_ns < self._instruction_ns  # unknown either way: current
            return Observation(images, self._state.copy(), self._instruction, mask,
                               after_instruction=not stale)  # fmt: skip
