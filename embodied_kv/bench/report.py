"""What every benchmark shares: the device's name, a table on stdout, atomic JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
from pathlib import Path

import torch


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} x{os.cpu_count()}"


def set_cpu_threads(n: int) -> None:
    """Torch's intra-op threads on the CPU. One is the default: the tiny preset's ops are
    too small to split, and with two threads on two busy cores one decode step was
    measured here at 415 ms instead of 4 ms (OpenMP workers waiting on each other)."""
    if n < 1:
        raise ValueError(f"threads={n} must be >= 1")
    torch.set_num_threads(n)


def stamp() -> dict:
    """Date and software versions recorded with every result."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def write_json(result: dict, path: str | Path) -> None:
    """Write `result` plus the stamp to `path` atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({**stamp(), **result}, f, indent=2, default=float)
        f.write("\n")
    os.replace(tmp, path)


def print_table(header: list[str], rows: list[list]) -> None:
    def fmt(v):
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [header] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
