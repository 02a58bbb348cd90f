"""The planner's memory as reusable KV (KEEP, docs/keep.md): segments, groups, host-tier KV.

A segment is one piece of text keyed by id (the MemoryUpdate msg: add / update /
remove). Segments belong to groups: the msg's explicit `group`, else the group whose
mean-pooled token embedding (the backbone's own embedding table) is the most similar
to the segment's, at or above a threshold, else a new group. A group whose segments
have not changed for the last `window` updates is *static*: its KV is one block
computed jointly over its segments; any other group is *dynamic*: each segment has a
block of its own, so an update invalidates that segment only. A change to a static
group makes it dynamic at once (its joint block is dropped and each segment is
computed alone once); a dynamic group that reaches the window is computed jointly
once. `refresh` computes whatever is missing, through a caller's `compute(texts)`.

The prompt lists the segments group by group (groups in order of their first
segment, segments in insertion order), so a static group's segments are contiguous
and its joint block can be placed whole:

    \\nFacts: | s1 s2 (group a, static: 1 block) | s3 (group b, dynamic) | s4 | \\nQuery: ...

Blocks stay where they were computed (the arena's device) while the memory's device
blocks fit `device_bytes` (a pi05 memory of 40 segments is ~30 MB); past it a new
block goes to the host tier (pinned on CUDA), so a plan moves no block across the bus
unless the memory outgrew its budget. K after RoPE at the positions they were
computed at (`pos0` onward), V as is. Placing a block elsewhere re-rotates its
keys (kv/memory_kv.py). The memory is part of the session: a capsule carries the
segments, groups and blocks (`state_*`), and `clear` empties it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

HEADER = "\nFacts:"  # the world's memory prompt (world/memory.py MemoryQuery.prompt)


def query_suffix(goal: str) -> str:
    return f"\nQuery: {goal}\nAnswer: "


def piece(text: str) -> str:
    """A segment's text as it appears after the header: a space, then the text."""
    return " " + text


class MemoryOp(enum.IntEnum):  # = MemoryUpdate.OP_*
    ADD = 0
    UPDATE = 1
    REMOVE = 2


@dataclass(frozen=True)
class MemoryConfig:
    window: int = 10  # KEEP t: updates without a change before a group is static
    group_threshold: float = 0.9  # cosine of mean-pooled embeddings to join a group
    static_groups: bool = True  # False: every group stays dynamic (the KEEP ablation)
    device_bytes: int = 256 << 20  # bytes of blocks kept on the device; beyond: host tier

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        if not -1.0 <= self.group_threshold <= 1.0:
            raise ValueError(f"group_threshold={self.group_threshold} must be in [-1, 1]")
        if self.device_bytes < 0:
            raise ValueError(f"device_bytes={self.device_bytes} must be >= 0")


@dataclass(frozen=True)
class KVBlock:
    """KV of one unit (a dynamic segment or a static group), host tier."""

    k: torch.Tensor  # [L, n, Hkv, D] after RoPE at positions pos0 .. pos0 + n - 1
    v: torch.Tensor  # [L, n, Hkv, D]
    pos0: int
    spans: tuple[tuple[int, int], ...]  # (first row, rows) of each segment in the block

    @property
    def rows(self) -> int:
        return int(self.k.shape[1])


@dataclass(frozen=True)
class Unit:
    """What a prompt places: a static group's block whole, or one dynamic segment."""

    key: str  # "group:<name>" or "seg:<id>"
    segments: tuple[str, ...]
    texts: tuple[str, ...]


@dataclass
class _Segment:
    text: str
    group: str


@dataclass
class _Group:
    members: list[str] = field(default_factory=list)
    last_change: int = 0  # the update clock at its latest change
    static: bool = False  # the mode its blocks were computed in


@dataclass
class MemoryCounters:
    """Process counters (diagnostics; not session state)."""

    computed_segments: int = 0  # blocks computed for one dynamic segment
    computed_groups: int = 0  # blocks computed jointly for a static group
    to_dynamic: int = 0  # static groups an update made dynamic
    to_static: int = 0  # dynamic groups that reached the window
    invalidated: int = 0  # blocks dropped by updates


Embedder = Callable[[str], torch.Tensor]  # text -> [W] mean-pooled embedding
Computer = Callable[[list[str]], KVBlock]  # segment texts (one unit, in order) -> its block


class SegmentMemory:
    """Thread-safe on its own lock: updates arrive on the executor thread."""

    def __init__(self, cfg: MemoryConfig | None = None, embed: Embedder | None = None):
        self.cfg = cfg or MemoryConfig()
        self.embed = embed
        self.counters = MemoryCounters()
        self._lock = threading.RLock()
        self._vectors: dict[str, torch.Tensor] = {}  # text -> embedding (a cache)
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self.segments: dict[str, _Segment] = {}
            self.groups: dict[str, _Group] = {}
            self.blocks: dict[str, KVBlock] = {}
            self.clock = 0  # updates applied
            self.auto_groups = 0  # groups named by similarity so far

    def __len__(self) -> int:
        return len(self.segments)

    # -- updates -------------------------------------------------------------------------

    def apply(self, op: int, key: str, text: str, max_segments: int, group: str = "") -> None:
        """One update; ValueError (memory unchanged) for an unknown op, an add of an
        existing key, an update/remove of a missing one, empty text, a full memory."""
        with self._lock:
            op = self._check(op, key, text, max_segments)
            self.clock += 1
            if op is MemoryOp.REMOVE:
                seg = self.segments.pop(key)
                g = self.groups[seg.group]
                g.members.remove(key)
                self._changed(seg.group, key)
                if not g.members:
                    del self.groups[seg.group]
                return
            old = self.segments.get(key)
            name = group or (old.group if old else self._similar_group(text))
            if old is not None and old.group != name:  # moved: it leaves its old group
                self.groups[old.group].members.remove(key)
                self._changed(old.group, key)
                if not self.groups[old.group].members:
                    del self.groups[old.group]
            self.segments[key] = _Segment(text, name)
            g = self.groups.setdefault(name, _Group(last_change=self.clock))
            if key not in g.members:
                g.members.append(key)
            self._changed(name, key)

    def _check(self, op: int, key: str, text: str, max_segments: int) -> MemoryOp:
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
        if op is not MemoryOp.REMOVE and not text:
            raise ValueError(f"segment {key!r}: empty text")
        if op is MemoryOp.ADD and len(self.segments) >= max_segments:
            raise ValueError(f"memory is full ({len(self.segments)} segments = max_segments)")
        return op

    def _changed(self, name: str, key: str) -> None:
        """Group `name` changed through segment `key`: invalidate what that costs."""
        g = self.groups[name]
        g.last_change = self.clock
        if g.static:  # static -> dynamic: the joint block goes, each segment is computed
            g.static = False
            self.counters.to_dynamic += 1
            self.counters.invalidated += int(self.blocks.pop(f"group:{name}", None) is not None)
        self.counters.invalidated += int(self.blocks.pop(f"seg:{key}", None) is not None)

    def _similar_group(self, text: str) -> str:
        """The most similar group at or above the threshold, else a new one."""
        if self.embed is not None and self.groups:
            v = self._vector(text)
            best, score = None, -2.0
            for name, g in self.groups.items():
                c = torch.stack([self._vector(self.segments[m].text) for m in g.members]).mean(0)
                s = float(torch.nn.functional.cosine_similarity(v, c, dim=0))
                if s > score:
                    best, score = name, s
            if score >= self.cfg.group_threshold:
                return best
        self.auto_groups += 1
        return f"auto-{self.auto_groups}"

    def _vector(self, text: str) -> torch.Tensor:
        if text not in self._vectors:
            self._vectors[text] = self.embed(text).float().cpu()
        return self._vectors[text]

    # -- modes, blocks, retrieval ----------------------------------------------------------

    def is_static(self, name: str) -> bool:
        g = self.groups[name]
        return self.cfg.static_groups and self.clock - g.last_change >= self.cfg.window

    def units(self, ids: list[str] | None = None) -> list[Unit]:
        """The prompt's units in order; with `ids`, only what retrieval selects: a static
        group whole if any of its segments is asked for, dynamic segments one by one."""
        with self._lock:
            want = None if ids is None else set(ids)
            if want is not None and not want <= set(self.segments):
                raise ValueError(f"unknown segments {sorted(want - set(self.segments))}")
            out = []
            for name, g in self.groups.items():
                if self.is_static(name):
                    if want is None or want & set(g.members):
                        texts = tuple(self.segments[m].text for m in g.members)
                        out.append(Unit(f"group:{name}", tuple(g.members), texts))
                    continue
                for m in g.members:
                    if want is None or m in want:
                        out.append(Unit(f"seg:{m}", (m,), (self.segments[m].text,)))
            return out

    def refresh(self, compute: Computer, units: list[Unit] | None = None) -> int:
        """Compute every missing block of `units` (default: all) -> blocks computed. A
        group reaching the window turns static here (its segments' blocks go)."""
        with self._lock:
            units = self.units() if units is None else units
            made = 0
            for unit in units:
                if unit.key in self.blocks:
                    continue
                block = self._placed(compute(list(unit.texts)))
                self.blocks[unit.key] = block
                made += 1
                if unit.key.startswith("group:"):
                    name = unit.key.removeprefix("group:")
                    g = self.groups[name]
                    self.counters.computed_groups += 1
                    self.counters.to_static += int(not g.static)
                    g.static = True
                    for m in g.members:
                        self.blocks.pop(f"seg:{m}", None)
                else:
                    self.counters.computed_segments += 1
            return made

    def _placed(self, block: KVBlock) -> KVBlock:
        """A new block kept where it is if the device blocks stay within budget, else a
        host-tier copy (a block on the host stays there)."""
        if block.k.device.type == "cpu":
            return block
        size = block.k.nbytes + block.v.nbytes
        held = sum(b.k.nbytes + b.v.nbytes for b in self.blocks.values()
                   if b.k.device.type != "cpu")  # fmt: skip
        if held + size <= self.cfg.device_bytes:
            return block
        return KVBlock(host_tier(block.k), host_tier(block.v), block.pos0, block.spans)

    def prompt(self, goal: str) -> str:
        """The plan request's text: header, every segment in unit order, the query."""
        with self._lock:
            texts = [t for u in self.units() for t in u.texts]
        return HEADER + "".join(piece(t) for t in texts) + query_suffix(goal)

    def summary(self) -> dict:
        """Sizes and process counters (diagnostics)."""
        with self._lock:
            static = sum(self.is_static(n) for n in self.groups)
            nbytes = {"cpu": 0, "device": 0}
            for b in self.blocks.values():
                nbytes["cpu" if b.k.device.type == "cpu" else "device"] += b.k.nbytes + b.v.nbytes
            return {"segments": len(self.segments), "groups": len(self.groups),
                    "static_groups": static, "blocks": len(self.blocks),
                    "host_bytes": nbytes["cpu"], "device_bytes": nbytes["device"],
                    **vars(self.counters)}  # fmt: skip

    # -- capsule section (kv.capsule.Stateful) ---------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        with self._lock:
            out = {}
            for i, b in enumerate(self.blocks.values()):
                out[f"kv{i}.k"], out[f"kv{i}.v"] = b.k, b.v
            return out

    def state_meta(self) -> dict:
        with self._lock:
            return {
                "segments": [[k, s.text, s.group] for k, s in self.segments.items()],
                "groups": [[n, list(g.members), g.last_change, g.static]
                           for n, g in self.groups.items()],  # fmt: skip
                "blocks": [[k, b.pos0, [list(s) for s in b.spans]] for k, b in self.blocks.items()],
                "clock": self.clock,
                "auto_groups": self.auto_groups,
            }

    def check_state(self, tensors: dict, meta: dict) -> None:
        try:
            segs = {k: (t, g) for k, t, g in meta["segments"]}
            groups = {n: list(m) for n, m, _, _ in meta["groups"]}
            int(meta["clock"]), int(meta["auto_groups"])
            if sorted(k for m in groups.values() for k in m) != sorted(segs):
                raise ValueError("group members and segments differ")
            for i, (key, pos0, spans) in enumerate(meta["blocks"]):
                k, v = tensors[f"kv{i}.k"], tensors[f"kv{i}.v"]
                n = sum(int(s[1]) for s in spans)
                if k.shape != v.shape or k.dim() != 4 or k.shape[1] != n or int(pos0) < 0:
                    raise ValueError(f"block {key!r}: k {tuple(k.shape)}, v {tuple(v.shape)}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"memory section: {type(e).__name__}: {e}") from e

    def load_state(self, tensors: dict, meta: dict) -> None:
        with self._lock:
            self.segments = {k: _Segment(t, g) for k, t, g in meta["segments"]}
            self.groups = {
                n: _Group(list(m), int(c), bool(s)) for n, m, c, s in meta["groups"]
            }
            self.blocks = {}
            for i, (key, pos0, spans) in enumerate(meta["blocks"]):
                k, v = host_tier(tensors[f"kv{i}.k"]), host_tier(tensors[f"kv{i}.v"])
                spans = tuple((int(a), int(b)) for a, b in spans)
                self.blocks[key] = KVBlock(k, v, int(pos0), spans)
            self.clock, self.auto_groups = int(meta["clock"]), int(meta["auto_groups"])


def host_tier(t: torch.Tensor) -> torch.Tensor:
    """A private host copy of t: pinned when CUDA is there (async copies to the device)."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if torch.cuda.is_available() else out
