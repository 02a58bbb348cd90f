"""The action queue between the engine (a chunk per cycle) and the fixed-rate output.

A chunk computed from the observation of control tick t0 holds the actions for ticks
t0 .. t0+H-1. The consumer pops one action per tick. A new chunk replaces the old
one from its own start; over the first `blend` ticks where both cover the same tick
the two are mixed linearly (old weight falling from blend/(blend+1) to 1/(blend+1)).
If the consumer reaches a tick that no chunk covers, it repeats the last action and
counts a deadline miss. Deterministic; thread-safe (the ROS output thread pops).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class QueueCounters:
    chunks: int = 0
    ticks: int = 0
    misses: int = 0  # ticks with no fresh action: the last one was repeated
    held: int = 0  # ticks that repeated the last action on purpose (hold)


class ActionQueue:
    def __init__(self, horizon: int, action_dim: int, blend: int = 0):
        if not 0 <= blend < horizon:
            raise ValueError(f"blend={blend} must be in [0, horizon={horizon})")
        self.horizon, self.action_dim, self.blend = horizon, action_dim, blend
        self._chunk: np.ndarray | None = None  # [H, A] float64
        self._start = 0  # tick of the chunk's first action
        self._last = np.zeros(action_dim)
        self._held = False  # hold(): repeat the last action until the next push
        self._lock = threading.Lock()
        self.counters = QueueCounters()

    def push(self, chunk: np.ndarray, start_tick: int) -> None:
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.shape != (self.horizon, self.action_dim):
            raise ValueError(f"chunk {chunk.shape} != ({self.horizon}, {self.action_dim})")
        with self._lock:
            self.counters.chunks += 1
            new = chunk.copy()
            if self._chunk is not None and self.blend:
                for i in range(self.blend):
                    old_i = start_tick + i - self._start
                    if 0 <= old_i < self.horizon:
                        w = (i + 1) / (self.blend + 1)
                        new[i] = w * chunk[i] + (1 - w) * self._chunk[old_i]
            self._chunk, self._start, self._held = new, start_tick, False

    def hold(self) -> None:
        """Drop the chunk: every tick repeats the last action until the next push (a
        cancelled goal, an engine in its safe state)."""
        with self._lock:
            self._chunk, self._held = None, True

    def pop(self, tick: int) -> tuple[np.ndarray, bool]:
        """The action for `tick` and whether it is fresh (False: a repeat, a miss)."""
        with self._lock:
            self.counters.ticks += 1
            i = tick - self._start
            if self._chunk is not None and 0 <= i < self.horizon:
                self._last = self._chunk[i]
                return self._last.copy(), True
            if self._held:
                self.counters.held += 1
                return self._last.copy(), True
            self.counters.misses += 1
            return self._last.copy(), False

    # -- capsule section (kv.capsule.Stateful) ---------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        with self._lock:
            out = {"last": torch.from_numpy(self._last.copy())}
            if self._chunk is not None:
                out["chunk"] = torch.from_numpy(self._chunk.copy())
            return out

    def state_meta(self) -> dict:
        with self._lock:  # counters describe the process: not state, never restored
            return {"start": self._start, "held": self._held}

    def check_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        last, chunk = tensors.get("last"), tensors.get("chunk")
        if last is None or tuple(last.shape) != (self.action_dim,):
            raise ValueError(f"queue section: last action {None if last is None else last.shape}")
        if chunk is not None and tuple(chunk.shape) != (self.horizon, self.action_dim):
            raise ValueError(f"queue section: chunk {tuple(chunk.shape)}")
        int(meta["start"])

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with self._lock:
            self._chunk = tensors["chunk"].cpu().numpy().copy() if "chunk" in tensors else None
            self._last = tensors["last"].cpu().numpy().copy()
            self._start = int(meta["start"])
            self._held = bool(meta.get("held", False))
