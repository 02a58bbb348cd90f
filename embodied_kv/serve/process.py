"""`embodied-kv serve` as a child process: started, waited for, stopped (tests, bench)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"serving ws://(\S+):(\d+)")


class ServeProcess:
    """`python -m embodied_kv.cli serve ARGS --port 0`; `.port` once it listens."""

    def __init__(self, *args: str, start_timeout_s: float = 120.0, env: dict | None = None):
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), child_env.get("PYTHONPATH", "")) if p
        )
        argv = [sys.executable, "-m", "embodied_kv.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[str] = []
        self.port = self._wait_ready(start_timeout_s)
        # keep draining the output so a chatty server never blocks on a full pipe
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            m = READY.search(line)
            if m:
                return int(m.group(2))
        self.proc.kill()
        raise RuntimeError("embodied-kv serve did not start:\n" + "\n".join(self.lines[-30:]))

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig`; the exit code (killed after timeout_s: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
