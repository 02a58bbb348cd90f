"""Layer-balanced loading of memory KV (KEEP): host tier -> the request's slot, layer
by layer, overlapped with the selective prefill's compute.

A segment's cached KV of layer l is needed iff the segment is not recomputed at l.
What is recomputed at layer i + 1 is decided only after layer i, so:

    before layer 0   copy layer 0 of the segments not computed at layer 0 (no overlap)
    during layer i   copy layer i + 1 of every segment not copied yet (those still
                     active may be dropped after layer i: a speculative copy, later
                     overwritten if recomputed), then preload deeper layers of the
                     segments already dropped (never recomputed again) while the
                     copies issued at this point stay within `budget_rows`

so the copy engine works about as much at every layer instead of all at once. On
CUDA the copies run on a side stream from pinned memory, each layer's compute waits
on the event after the last copy of that layer; on the CPU the same schedule runs as
plain copies. Re-rotation of the copied keys runs on the compute stream at the wait.
`overlap=False` copies everything before layer 0 (the ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kv.arena import KVArena
from embodied_kv.kv.memory import KVBlock
from embodied_kv.kv.memory_kv import rerotate
from embodied_kv.model.layers import Rope


@dataclass(frozen=True)
class Copy:
    layer: int
    unit: int  # index of a segment in the prompt's segment list


class LoadSchedule:
    """Which copies are issued at which point: pure bookkeeping, tested on its own.

    `issue(i, active)` is called right before layer i computes, with the segments
    computed at layer i; it returns the copies to issue there, in order."""

    def __init__(
        self, num_layers: int, unit_rows: list[int], budget_rows: int = 0, overlap: bool = True
    ):
        if num_layers < 1 or any(r < 1 for r in unit_rows) or budget_rows < 0:
            raise ValueError(f"bad schedule: {num_layers} layers, rows {unit_rows}, {budget_rows}")
        self.num_layers, self.rows, self.overlap = num_layers, list(unit_rows), overlap
        self.budget = budget_rows or sum(unit_rows)  # one layer of every segment
        self.done: set[tuple[int, int]] = set()  # (layer, unit) issued
        self.dropped: dict[int, int] = {}  # unit -> first layer it is not computed at
        self.points: list[list[Copy]] = []  # copies per issue point (point i: before layer i)

    def issue(self, i: int, active: set[int]) -> list[Copy]:
        if i != len(self.points):
            raise ValueError(f"issue({i}) out of order after {len(self.points)} points")
        units = range(len(self.rows))
        for u in units:
            if u not in active and u not in self.dropped:
                self.dropped[u] = i
        out: list[Copy] = []
        if not self.overlap:  # everything that may be needed, before layer 0
            if i == 0:
                out = [Copy(layer, u) for layer in range(self.num_layers) for u in units
                       if layer > 0 or u not in active]  # fmt: skip
            return self._take(out)
        out += [Copy(i, u) for u in units if u not in active]  # needed now (before compute)
        if i + 1 < self.num_layers:
            out += [Copy(i + 1, u) for u in units]  # speculative for the still active
        out = [c for c in out if (c.layer, c.unit) not in self.done]
        used = sum(self.rows[c.unit] for c in out)
        for layer in range(i + 2, self.num_layers):  # preload the dropped, shallow first
            for u in sorted(self.dropped):
                if used >= self.budget:
                    break
                if (layer, u) not in self.done:
                    out.append(Copy(layer, u))
                    used += self.rows[u]
        return self._take(out)

    def _take(self, out: list[Copy]) -> list[Copy]:
        out = [c for c in out if (c.layer, c.unit) not in self.done]
        self.done |= {(c.layer, c.unit) for c in out}
        self.points.append(out)
        return out


@dataclass(frozen=True)
class Source:
    """Where a segment's cached rows come from and go to."""

    block: KVBlock
    block_row: int  # first row in the block
    slot_row: int  # first row in the slot
    n: int
    delta: int  # placement position - cached position (re-rotation)


class LayerLoader:
    """Runs a LoadSchedule: copies host-tier rows into one slot, re-rotates keys."""

    def __init__(self, arena: KVArena, slot: int, rope: Rope, sources: list[Source],
                 schedule: LoadSchedule):  # fmt: skip
        self.arena, self.slot, self.rope = arena, slot, rope
        self.sources, self.schedule = sources, schedule
        self.cuda = arena.device.type == "cuda"
        self.stream = torch.cuda.Stream(arena.device) if self.cuda else None
        self.events: dict[int, torch.cuda.Event] = {}  # layer -> after its last copy
        self.pending: dict[int, list[int]] = {}  # layer -> units copied, not yet rotated
        # per unit, built once: its slot rows and each row's re-rotation distance
        self.rows = [torch.arange(s.slot_row, s.slot_row + s.n) for s in sources]
        self.deltas = [torch.full((s.n,), s.delta) for s in sources]

    def issue(self, i: int, active: set[int]) -> None:
        copies = self.schedule.issue(i, active)
        if not copies:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.arena.device))
            with torch.cuda.stream(self.stream):
                self._copy(copies)
        else:
            self._copy(copies)

    def _copy(self, copies: list[Copy]) -> None:
        """CUDA: one async copy per segment from pinned memory on the copy stream. CPU:
        one gather and one indexed write per layer (the copies are the host's own work)."""
        k, v = self.arena.k, self.arena.v
        by_layer: dict[int, list[int]] = {}  # layer -> units, in issue order
        for c in copies:
            by_layer.setdefault(c.layer, []).append(c.unit)
            self.pending.setdefault(c.layer, []).append(c.unit)
        for layer, units in by_layer.items():
            srcs = [self.sources[u] for u in units]
            if self.cuda:
                for s in srcs:
                    dst = slice(s.slot_row, s.slot_row + s.n)
                    src = slice(s.block_row, s.block_row + s.n)
                    k[layer, self.slot, dst].copy_(s.block.k[layer, src], non_blocking=True)
                    v[layer, self.slot, dst].copy_(s.block.v[layer, src], non_blocking=True)
                event = self.events.setdefault(layer, torch.cuda.Event())
                event.record(self.stream)
                continue
            rows = torch.cat([self.rows[u] for u in units])
            for cache, part in ((k, "k"), (v, "v")):
                got = [getattr(s.block, part)[layer, s.block_row : s.block_row + s.n] for s in srcs]
                cache[layer, self.slot].index_copy_(0, rows, torch.cat(got))

    def wait(self, i: int) -> None:
        """Before layer i computes: its copies are done and their keys re-rotated."""
        if self.cuda and i in self.events:
            torch.cuda.current_stream(self.arena.device).wait_event(self.events[i])
        units = self.pending.pop(i, [])
        if not units:
            return
        dev = self.arena.device
        rows = torch.cat([self.rows[u] for u in units]).to(dev)
        delta = torch.cat([self.deltas[u] for u in units]).to(dev)
        k = self.arena.k[i, self.slot]  # [T, Hkv, D]
        k[rows] = rerotate(self.rope, k[rows], delta).to(k.dtype)
