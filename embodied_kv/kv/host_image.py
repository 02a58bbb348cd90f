"""A request's cached memory rows packed in prompt order: one host tensor per K and V.

A plan prompt places rows of many blocks (one per static group or dynamic segment).
Copied block by block, a layer costs a copy per segment and K/V (276 cudaMemcpyAsync
for 40 segments on the H100, gpu-check 2026-11-23: KEEP was host-bound). Packed once
per request, the rows any set of units needs at one layer lie in one range of one
tensor, so a layer's copy is one transfer and one gather whatever the segment count:

    image row   0 ........................................................ R
                | unit 0 rows | unit 1 rows | unit 2 rows | ...            |
    slot row    row0 + the prompt token of each row (a unit without a block: a gap)

Pinned on CUDA (an async copy to the device). Per row, built once: its unit, its slot
row, and the re-rotation tables of its delta (placement position - cached position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kv.memory import KVBlock
from embodied_kv.kv.memory_kv import rerotation
from embodied_kv.kv.step import to_device
from embodied_kv.model.layers import Rope


@dataclass(frozen=True)
class Source:
    """Where a unit's (a segment's) cached rows come from and go to."""

    block: KVBlock
    block_row: int  # first row in the block
    slot_row: int  # first row in the slot
    n: int
    delta: int  # placement position - cached position (re-rotation)


@dataclass(frozen=True)
class HostImage:
    k: torch.Tensor  # [L, R, Hkv, D] host (pinned on CUDA): keys as cached, not re-rotated
    v: torch.Tensor  # [L, R, Hkv, D]
    start: tuple[int, ...]  # image row of each unit's first row, then R
    unit: torch.Tensor  # [R] int64 host: the unit of each row
    slot_row: torch.Tensor  # [R] int64 host: the slot row each row goes to
    cos: torch.Tensor  # [R, 1, D] fp32 on the arena's device: re-rotation of each row
    sin: torch.Tensor  # [R, 1, D]

    @property
    def rows(self) -> int:
        return self.start[-1]

    def rows_of(self, units: list[int]) -> tuple[int, int, torch.Tensor]:
        """-> (lo, hi, index): the image range [lo, hi) holding `units` and their rows in it
        ([r] int64 host, relative to lo, ascending)."""
        lo = min(self.start[u] for u in units)
        hi = max(self.start[u + 1] for u in units)
        if sum(self.start[u + 1] - self.start[u] for u in units) == hi - lo:
            return lo, hi, torch.arange(hi - lo)  # the units fill the range
        hit = torch.isin(self.unit[lo:hi], torch.tensor(units))
        return lo, hi, hit.nonzero().view(-1)


def pack(sources: list[Source], rope: Rope, device: torch.device) -> HostImage | None:
    """The rows of `sources` (the loader's units, prompt order) as one image; None if none.
    Consecutive rows of one block are one piece: a unit of several segments costs one."""
    if not sources:
        return None
    pieces: list[list] = []  # [block, first row, end row]
    for s in sources:
        last = pieces[-1] if pieces else None
        if last is not None and last[0] is s.block and last[2] == s.block_row:
            last[2] += s.n
        else:
            pieces.append([s.block, s.block_row, s.block_row + s.n])
    pin = device.type == "cuda"
    k = _cat([b.k if (a, e) == (0, b.rows) else b.k[:, a:e] for b, a, e in pieces], pin)
    v = _cat([b.v if (a, e) == (0, b.rows) else b.v[:, a:e] for b, a, e in pieces], pin)
    rows = torch.tensor([s.n for s in sources])
    start = [0, *torch.cumsum(rows, 0).tolist()]
    unit = torch.repeat_interleave(torch.arange(len(sources)), rows)  # [R]
    first = torch.tensor([[s.slot_row - a, s.delta] for s, a in zip(sources, start, strict=False)])
    slot_row, delta = first[unit].unbind(1)
    slot_row = slot_row + torch.arange(start[-1])
    cos, sin = rerotation(rope, to_device(delta, device))
    return HostImage(k, v, tuple(start), unit, slot_row, cos, sin)


def _cat(parts: list[torch.Tensor], pin: bool) -> torch.Tensor:
    """Concatenate along rows; a single whole block is used as it is (no copy)."""
    if len(parts) == 1 and parts[0].is_contiguous():
        return parts[0]
    shape = list(parts[0].shape)
    shape[1] = sum(p.shape[1] for p in parts)
    out = torch.empty(shape, dtype=parts[0].dtype, pin_memory=pin)
    return torch.cat(parts, dim=1, out=out)
