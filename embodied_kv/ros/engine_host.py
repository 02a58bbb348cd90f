"""One engine per process, shared by the five lifecycle nodes (docs/ros.md).

The first node to configure builds the engine (weights, the KV arena, warmup and,
on CUDA, graph capture) and takes the pinned `episode_start` capsule; the others
share it; the last node to clean up frees it. Between configure and cleanup the
host also holds what the nodes share around the engine: the control clock, the
cycle thread, the action output (registered by action_expert), the observation
source (registered by prefill) and the listeners that publish each cycle's result.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections import Counter
from collections.abc import Callable

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.engine.startup import start_engine
from embodied_kv.model.vla import Observation
from embodied_kv.ros.action_output import ActionOutput, ControlClock
from embodied_kv.ros.cycle_thread import CycleThread

Listener = Callable[[CycleResult, int], None]


class EngineHost:
    def __init__(self, progress: Callable[[str], None] | None = None):
        self._progress = progress or (lambda line: None)
        self._lock = threading.Lock()
        self._users: set[str] = set()
        self.cfg: EngineConfig | None = None
        self.engine: Engine | None = None
        self.clock: ControlClock | None = None
        self.cycles: CycleThread | None = None
        self.output: ActionOutput | None = None
        self.observation: Callable[[], Observation | None] = lambda: None
        self.observed_ns: Callable[[], int] = lambda: 0  # its capture, wall-clock ns; 0: none
        self.inputs_rejected: Counter[str] = Counter()  # by input kind, for /diagnostics
        self.build_s = 0.0
        self._listeners: dict[str, Listener] = {}
        self._log_error: Callable[[str], None] = lambda line: None

    # -- configure / cleanup ---------------------------------------------------------

    def acquire(self, user: str, cfg: EngineConfig, log_error: Callable[[str], None]) -> Engine:
        """The shared engine, built on first use; ValueError if `cfg` differs from it."""
        with self._lock:
            if self.engine is None:
                self._build(cfg)
                self._log_error = log_error
            elif cfg != self.cfg:
                raise ValueError(
                    f"engine parameters of {user} differ from the running engine's: "
                    f"{config_diff(self.cfg, cfg)} (put engine parameters in /**)"
                )
            self._users.add(user)
            return self.engine

    def release(self, user: str) -> bool:
        """Drop `user`; the last one frees the engine. True if it was freed."""
        with self._lock:
            self._users.discard(user)
            if self._users or self.engine is None:
                return False
            self.stop_cycles()
            device = self.engine.model.device
            self.engine = self.cycles = self.clock = self.cfg = None
            gc.collect()
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()
            return True

    def _build(self, cfg: EngineConfig) -> None:
        t = time.perf_counter()
        engine = start_engine(cfg, self._progress)
        self.cfg, self.engine = cfg, engine
        self.clock = ControlClock(cfg.control_hz)
        self.cycles = CycleThread(engine, self.clock, self._get_observation, self._dispatch,
                                  self._report, lambda: self.observed_ns())  # fmt: skip
        self.build_s = time.perf_counter() - t
        self._progress(f"engine ready in {self.build_s:.1f} s")

    # -- running -----------------------------------------------------------------------

    def start_cycles(self) -> None:
        if self.cycles is not None:
            self.cycles.start()

    def stop_cycles(self) -> None:
        if self.cycles is not None:
            self.cycles.stop()

    def listen(self, user: str, listener: Listener) -> None:
        self._listeners[user] = listener

    def unlisten(self, user: str) -> None:
        self._listeners.pop(user, None)

    def _get_observation(self) -> Observation | None:
        return self.observation()

    def _dispatch(self, result: CycleResult, tick: int) -> None:
        for user, listener in list(self._listeners.items()):
            try:
                listener(result, tick)
            except Exception as e:  # one node's publishing must not stop the others
                self._report(f"{user}: publishing cycle {result.frame}: {type(e).__name__}: {e}")

    def _report(self, line: str) -> None:
        self._log_error(line)


def config_diff(a: EngineConfig, b: EngineConfig) -> str:
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    return ", ".join(
        f"{n}={getattr(b, n)!r} (running: {getattr(a, n)!r})"
        for n in fields
        if getattr(a, n) != getattr(b, n)
    )
