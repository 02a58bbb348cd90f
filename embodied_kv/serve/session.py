"""One connection's session in the shared engine.

The engine holds one live session (engine.py); a connection's own state is what makes
its next chunk: the frame it is at (the chunk's noise is drawn with seed + frame, the
robot's rule) and the capsules it named. Each request sets the engine's frame to the
session's before its cycle and reads it back after, so clients never see each other's
frames; a snapshot carries the frame, so a restore replays the same chunks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from embodied_kv.engine.history import check_client_name

_ids = itertools.count(1)


@dataclass
class Session:
    id: int = field(default_factory=lambda: next(_ids))
    frame: int = 0  # chunks computed since connect or reset: the next chunk's frame
    capsules: dict[str, str] = field(default_factory=dict)  # client name -> engine capsule

    def capsule(self, name: object) -> str:
        """The engine's capsule name of this session's `name` (ValueError if not a name)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"snapshot name must be non-empty text, got {name!r}")
        full = f"serve{self.id}.{name}"
        check_client_name(full)
        return full
