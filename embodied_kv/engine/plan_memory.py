"""The planner's world memory as text segments: part of the session (a capsule carries
it, `reset` empties it with the rest of the episode).

Each plan re-reads the whole memory as text after the frame's prefix (full
recomputation): the baseline that memory kept as KV (KEEP, DESIGN §4, kv/memory.py
when it arrives) is measured against.
"""

from __future__ import annotations

import enum
import threading

import torch


class MemoryOp(enum.IntEnum):  # = MemoryUpdate.OP_*
    ADD = 0
    UPDATE = 1
    REMOVE = 2


class PlanMemory:
    """Thread-safe on its own lock: updates arrive on the executor thread while the
    engine cycle's history snapshot reads it."""

    def __init__(self) -> None:
        self.segments: dict[str, str] = {}  # segment_id -> text, in insertion order
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.segments)

    def clear(self) -> None:
        with self._lock:
            self.segments = {}

    def apply(self, op: int, key: str, text: str, max_segments: int) -> None:
        """One update; ValueError (memory unchanged) for an unknown op, an add of an
        existing key, an update/remove of a missing one, empty text, a full memory."""
        with self._lock:
            self._apply(op, key, text, max_segments)

    def _apply(self, op: int, key: str, text: str, max_segments: int) -> None:
        if op not in MemoryOp.__members__.values():
            raise ValueError(f"unknown operation {op} (use OP_ADD=0, OP_UPDATE=1, OP_REMOVE=2)")
        op = MemoryOp(op)
        name = op.name.lower()
        if not key:
            raise ValueError(f"{name} without a segment_id")
        if op is MemoryOp.ADD and key in self.segments:
            raise ValueError(f"add of segment {key!r}, which exists (use OP_UPDATE)")
        if op is not MemoryOp.ADD and key not in self.segments:
            raise ValueError(f"{name} of unknown segment {key!r}")
        if op is MemoryOp.REMOVE:
            del self.segments[key]
            return
        if not text:
            raise ValueError(f"segment {key!r}: empty text")
        if op is MemoryOp.ADD and len(self.segments) >= max_segments:
            raise ValueError(f"memory is full ({len(self.segments)} segments = max_segments)")
        self.segments[key] = text

    def prompt(self, goal: str) -> str:
        """The segments' texts in insertion order as the facts of a memory query, the goal
        as its query: world/memory.py MemoryQuery.prompt, the format the `world` model
        was trained on (one fact sentence per segment)."""
        with self._lock:
            facts = " ".join(self.segments.values())
        return f"\nFacts: {facts}\nQuery: {goal}\nAnswer: "

    # -- capsule section (kv.capsule.Stateful) ---------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict:
        with self._lock:
            return {"segments": [[k, v] for k, v in self.segments.items()]}

    def check_state(self, tensors: dict, meta: dict) -> None:
        segs = meta.get("segments")
        if not isinstance(segs, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in segs
        ):
            raise ValueError("memory section: segments must be [id, text] pairs")

    def load_state(self, tensors: dict, meta: dict) -> None:
        with self._lock:
            self.segments = {k: v for k, v in meta["segments"]}
