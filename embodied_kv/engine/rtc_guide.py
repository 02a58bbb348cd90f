"""The engine's side of real-time chunking (model/rtc.py): what a new chunk is guided
towards, read from the action queue at the cycle's start.

    previous chunk (model units), started at tick t_prev:   p_0 p_1 ... p_{H-1}
    new chunk, observed at tick t0 (shift = t0 - t_prev):   Y_i = p_{i + shift}, i < H - shift
                                                            W_i = 0 where Y has no value

d is the fixed `rtc.delay` or the queue's moving estimate of observation -> arrival; s is
`rtc.execution_horizon`, or the engine's replan_every (the ticks a chunk is executed before
the next one lands).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.model.rtc import Guide, RTCConfig, prefix_weights
from embodied_kv.storage.step import to_device


@dataclass
class RTCCounters:
    """Diagnostics of the guided chunks (never restored)."""

    chunks: int = 0  # chunks sampled with RTC on
    guided: int = 0  # of those, guided towards a previous chunk
    last_applied: bool = False  # the last chunk was guided
    last_delay: int | None = None  # d the last guided chunk used (ticks)
    # chunks from an observation older than its instruction: not kept as the plan
    stale_observations: int = 0


class ChunkGuide:
    def __init__(self, cfg: RTCConfig, horizon: int, replan_every: int, device,
                 action_dims: int = 0):  # fmt: skip
        """`action_dims`: the robot's action dims; the model's dims beyond them (padding,
        zero in every training chunk, any value in its output) are guided towards 0, not
        towards the old chunk's values there (0: every dim is the robot's)."""
        if not cfg.enabled:
            raise ValueError("ChunkGuide needs rtc.enabled: true")
        s = cfg.execution_horizon or replan_every
        if s > horizon:
            raise ValueError(f"rtc.execution_horizon={s} exceeds the chunk's {horizon} actions")
        self.cfg, self.horizon, self.s, self.device = cfg, horizon, s, torch.device(device)
        self.action_dims = action_dims
        self.counters = RTCCounters()

    def delay(self, queue: ActionQueue) -> int:
        if self.cfg.delay != "measured":
            return int(self.cfg.delay)
        d = queue.delay_ticks()
        return 0 if d is None else d

    def guide(self, queue: ActionQueue, start_tick: int) -> Guide | None:
        """The guide of the chunk observed at `start_tick`, or None (no previous chunk in
        model units, or none that reaches this tick): the plain Euler loop."""
        self.counters.chunks += 1
        prev = queue.previous(start_tick)
        guide = None
        if prev is not None and 0 <= prev[1] < self.horizon:
            model, shift = prev
            h = self.horizon
            y = torch.zeros(model.shape, dtype=torch.float32)  # [H, A_model]
            y[: h - shift] = torch.from_numpy(model[shift:])
            if self.action_dims:
                y[:, self.action_dims :] = 0.0
            d = self.delay(queue)
            # prefix (training-time RTC) holds the d stale rows (W = 1), error-guides the
            # schedule's rows after them (none with `hard`)
            w = prefix_weights(h, d, self.s, self.cfg.schedule, self.cfg.band)
            w[h - shift :] = 0.0
            guide = Guide(to_device(y, self.device), to_device(w, self.device), d)
        c = self.counters
        c.last_applied = guide is not None
        if guide is not None:
            c.guided, c.last_delay = c.guided + 1, guide.delay
        return guide
