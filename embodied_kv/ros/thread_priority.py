"""The action output thread's scheduling priority (Linux: a nice value per thread).

The output wakes every period for well under a millisecond of work; on a loaded machine
at the default nice 0 it waits for a core behind the engine's compute and every other
process (measured: a tick 53 ms late at load 5 on 2 cores). A lower nice value lets the
scheduler run it as soon as it wakes. Lowering it needs CAP_SYS_NICE (root, or a
container granted it; raising it never does): without it the thread keeps its priority
and /diagnostics says so (`output_nice`, `output_nice_note`).
"""

from __future__ import annotations

import os
import threading


def set_thread_nice(nice: int) -> tuple[int, str]:
    """Set the calling thread's nice value -> (the value it has now, why it differs or "")."""
    if not -20 <= nice <= 19:
        raise ValueError(f"nice must be in -20..19, got {nice}")
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # EPERM / EACCES without CAP_SYS_NICE
        return os.getpriority(os.PRIO_PROCESS, tid), f"not permitted ({e.strerror})"
    return os.getpriority(os.PRIO_PROCESS, tid), ""
