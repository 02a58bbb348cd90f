"""The action queue between the engine (a chunk per cycle) and the fixed-rate output.

A chunk computed from the observation of control tick t0 holds the actions for ticks
t0 .. t0+H-1. The consumer pops one action per tick. A new chunk replaces the old
one from its own start; over the first `blend` ticks from the one it lands at (the tick
after the last one popped: the ticks before are past) where both cover the same tick the
two are mixed linearly (old weight falling from blend/(blend+1) to 1/(blend+1)).
If the consumer reaches a tick that no chunk covers, it repeats the last action and
counts a deadline miss. Deterministic; thread-safe (the ROS output thread pops).

For real-time chunking (model/rtc.py) the queue also keeps the current chunk in the model's
normalised units (`previous`) and measures the inference delay d: a chunk observed at tick
t0 lands at the tick after the last one popped, so d = that tick - t0, a moving estimate
(`delay_ticks`). The first action popped from a chunk that replaced another is a switch;
its jump |a_t - a_{t-1}| (L2, robot units) is counted in `switches`.
"""

from __future__ import annotations

import math
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


@dataclass
class SwitchStats:
    """Chunk boundaries as the robot saw them (diagnostics; never restored)."""

    switches: int = 0  # first actions popped from a chunk that replaced another
    last_jump: float = 0.0  # |a_t - a_{t-1}| (L2, robot units) at the last switch
    max_jump: float = 0.0
    last_delay: int | None = None  # ticks from the last chunk's observation to its arrival


class ActionQueue:
    def __init__(self, horizon: int, action_dim: int, blend: int = 0, delay_ema: float = 0.5):
        if not 0 <= blend < horizon:
            raise ValueError(f"blend={blend} must be in [0, horizon={horizon})")
        if not 0 < delay_ema <= 1:
            raise ValueError(f"delay_ema={delay_ema} must be in (0, 1]")
        self.horizon, self.action_dim, self.blend = horizon, action_dim, blend
        self._chunk: np.ndarray | None = None  # [H, A] float64
        self._start = 0  # tick of the chunk's first action
        self._last = np.zeros(action_dim)
        self._held = False  # hold(): repeat the last action until the next push
        self._lock = threading.Lock()
        self.counters = QueueCounters()
        self._model: np.ndarray | None = None  # [H, A_model] float32: the chunk in model units
        self._next_tick: int | None = None  # the tick after the last one popped
        self._switch = False  # the next pop from the chunk is a switch
        self._delay_ema, self._delay = delay_ema, None  # moving estimate of d (ticks)
        self.switches = SwitchStats()

    def push(
        self, chunk: np.ndarray, start_tick: int, model_chunk: np.ndarray | None = None
    ) -> None:
        """chunk [H, A] robot units for ticks start_tick.. on; `model_chunk` [H, A_model]: the
        same chunk in model units, kept for real-time chunking (`previous`)."""
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.shape != (self.horizon, self.action_dim):
            raise ValueError(f"chunk {chunk.shape} != ({self.horizon}, {self.action_dim})")
        if model_chunk is not None and (model_chunk.ndim != 2 or len(model_chunk) != self.horizon):
            raise ValueError(f"model chunk {model_chunk.shape}: expected {self.horizon} rows")
        with self._lock:
            if self._next_tick is not None:  # something was popped: the chunk lands there
                d = max(0, self._next_tick - start_tick)
                e = self._delay_ema
                # a longer delay is taken at once, a shorter one approached at delay_ema a
                # chunk: the estimate errs long (an action held too many costs a tick of
                # reaction; one too few is executed from the old chunk unheld: a jump)
                self._delay = d if self._delay is None else max(d, (1 - e) * self._delay + e * d)
                self.switches.last_delay = d
            self._switch = self._chunk is not None
            self._model = None if model_chunk is None else np.array(model_chunk, np.float32)
            self.counters.chunks += 1
            new = chunk.copy()
            if self._chunk is not None and self.blend:  # from the tick it lands at on
                first = 0 if self._next_tick is None else max(0, self._next_tick - start_tick)
                for i in range(self.blend):
                    j, old_i = first + i, start_tick + first + i - self._start
                    if j < self.horizon and 0 <= old_i < self.horizon:
                        w = (i + 1) / (self.blend + 1)
                        new[j] = w * chunk[j] + (1 - w) * self._chunk[old_i]
            self._chunk, self._start, self._held = new, start_tick, False

    def hold(self) -> None:
        """Drop the chunk: every tick repeats the last action until the next push (a
        cancelled goal, an engine in its safe state)."""
        with self._lock:
            self._chunk, self._model, self._held = None, None, True

    def forget_plan(self) -> None:
        """The chunk keeps executing, but the next one is not guided towards it (real-time
        chunking): the robot's task changed, so the old chunk's plan is not the new one's."""
        with self._lock:
            self._model = None

    def previous(self, start_tick: int) -> tuple[np.ndarray, int] | None:
        """(the current chunk in model units [H, A_model] float32, start_tick - its start
        tick), or None without one (nothing pushed with model units, held, a new episode)."""
        with self._lock:
            if self._model is None or self._chunk is None:
                return None
            return self._model.copy(), start_tick - self._start

    def delay_ticks(self) -> int | None:
        """The moving estimate of d rounded to ticks (halves up); None before any chunk
        landed after a pop."""
        with self._lock:
            return None if self._delay is None else math.floor(self._delay + 0.5)

    def pop(self, tick: int) -> tuple[np.ndarray, bool]:
        """The action for `tick` and whether it is fresh (False: a repeat, a miss)."""
        with self._lock:
            self.counters.ticks += 1
            self._next_tick = tick + 1
            i = tick - self._start
            if self._chunk is not None and 0 <= i < self.horizon:
                if self._switch:
                    jump = float(np.linalg.norm(self._chunk[i] - self._last))
                    sw = self.switches
                    sw.switches, sw.last_jump = sw.switches + 1, jump
                    sw.max_jump = max(sw.max_jump, jump)
                    self._switch = False
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
            if self._model is not None:  # real-time chunking on
                out["model_chunk"] = torch.from_numpy(self._model.copy())
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
        model = tensors.get("model_chunk")
        if model is not None and (model.dim() != 2 or model.shape[0] != self.horizon):
            raise ValueError(f"queue section: model chunk {tuple(model.shape)}")
        int(meta["start"])

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with self._lock:
            self._chunk = tensors["chunk"].cpu().numpy().copy() if "chunk" in tensors else None
            self._last = tensors["last"].cpu().numpy().copy()
            self._start = int(meta["start"])
            self._held = bool(meta.get("held", False))
            model = tensors.get("model_chunk")
            self._model = None if model is None else model.cpu().numpy().astype(np.float32)
            self._next_tick, self._switch = None, False  # a new timeline: no pop, no switch yet
