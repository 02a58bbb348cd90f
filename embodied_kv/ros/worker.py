"""A named daemon thread that runs `_run` from start() until stop() (the output and
engine-cycle threads). `_run` waits on `self._stop` between its scheduled beats."""

from __future__ import annotations

import threading


class Worker:
    THREAD_NAME = "worker"
    STOP_TIMEOUT_S = 2.0  # how long stop() waits for the beat in progress

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._on_start()
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.STOP_TIMEOUT_S if timeout is None else timeout)
        self._thread = None

    def _on_start(self) -> None:
        """Reset per-run state before the thread starts."""

    def _run(self) -> None:
        raise NotImplementedError
