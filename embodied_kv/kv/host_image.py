"""A request's cached memory rows packed in prompt order: one host tensor per K and V.

A plan prompt places rows of many blocks (one per static group or dynamic segment).
Copied block by block, a layer costs a copy per segment and K/V (276 cudaMemcpyAsync
for 40 segments on the H100, gpu-check 2026-11-23: KEEP was host-bound). Packed once
per request, the rows any set of units needs at one layer lie in one range of one
tensor, so a layer's copy is one transfer and one gather whatever the segment count:

    image row   0 ........................................................ R
                | unit 0 rows | unit 1 rows | unit 2 rows | ...            |
    slot row    row0 + the prompt token of each row (a unit without a block: a gap)

Where the blocks are: on the device when any block is (the memory keeps its blocks
there within its budget, kv/memory.py: then a layer's copy never crosses the bus),
else on the host, pinned on CUDA (an async copy to the device). Per row, built once:
its unit, its slot row, and the re-rotation tables of its delta (placement position -
cached position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kv.memory import KVBlock
from embodied_kv.kv.memory_kv import rerotation
from embodied_kv.model.layers import Rope
from embodied_kv.storage.step import to_device


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
    pieces = _pieces(sources)
    where = _home(pieces)
    pin = device.type == "cuda" and where is None
    k = _cat([b.k[:, a:e] for b, a, e in pieces], pin, where)  # a whole block: a view of it
    v = _cat([b.v[:, a:e] for b, a, e in pieces], pin, where)
    return _placed(sources, k, v, rope, device)


class ImageCache:
    """The previous request's image, brought up to date in place for the next one.

    Between two plan requests the memory usually changes by a few blocks (an update
    replaces one segment's block; KVBlocks are never written after they are made, so a
    block is unchanged iff it is the same object). When the new prompt has the same
    pieces' row counts, only the changed pieces are copied into the image (pi05 shapes,
    40 segments of 40 rows, bf16, one block new: 0.05 ms to copy its 0.7 MB where a
    ~30 MB repack took 2.3-2.8 ms on a 2-core EPYC; the rest of a request's 0.75 ms
    there is the rows' re-rotation tables, device work on CUDA); otherwise it is
    packed anew. On CUDA the image is written only after the previous request's copies
    from it are done (`fence`, recorded after its prefill).
    The cache holds the blocks it packed, so an object id is never reused under it.
    `device`: keep the image there instead of the host (the graphed KEEP prefill,
    engine/keep_graph.py: a block's rows cross to the GPU once, when it is new)."""

    def __init__(self, device: torch.device | None = None):
        self.device = device if device is not None and device.type == "cuda" else None
        self.pieces: list[list] = []  # [block, first row, end row] of the image
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.event = None  # CUDA: after the last request read the image
        self.written_rows = 0  # rows copied into the image by the last `pack` (a count)

    def pack(self, sources: list[Source], rope: Rope, device: torch.device) -> HostImage | None:
        if not sources:  # an emptied memory (reset): let the old image and blocks go
            self.pieces, self.k, self.v = [], None, None
            return None
        pieces = _pieces(sources)
        first = pieces[0][0].k
        shape = (first.shape[0], sum(e - a for _, a, e in pieces), *first.shape[2:])
        same = (
            self.k is not None and self.k.shape == shape and self.k.dtype == first.dtype
            and [e - a for _, a, e in pieces] == [e - a for _, a, e in self.pieces]
        )  # fmt: skip
        if self.event is not None:
            self.event.synchronize()  # no copy from the image still in flight
        where = self.device or _home(pieces)  # device blocks: a device image
        same = same and self.k.device == (where or torch.device("cpu"))
        if not same:
            pin = device.type == "cuda" and where is None
            self.k, self.v = (torch.empty(shape, dtype=first.dtype, pin_memory=pin,
                                          device=where) for _ in range(2))  # fmt: skip
            self.pieces = [[None, 0, 0]] * len(pieces)
        self.written_rows, offset = 0, 0
        for (b, a, e), (ob, oa, _) in zip(pieces, self.pieces, strict=True):
            if ob is not b or oa != a:
                self.k[:, offset : offset + e - a].copy_(b.k[:, a:e], non_blocking=True)
                self.v[:, offset : offset + e - a].copy_(b.v[:, a:e], non_blocking=True)
                self.written_rows += e - a
            offset += e - a
        self.pieces = pieces
        return _placed(sources, self.k, self.v, rope, device)

    def fence(self, device: torch.device, copy_stream=None) -> None:
        """After a prefill that read the image: the next `pack` waits for its copies (on
        `copy_stream` too: a prefill that failed mid-way left some unwaited)."""
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            if copy_stream is not None:
                current.wait_stream(copy_stream)
            self.event = torch.cuda.Event()
            self.event.record(current)


def _pieces(sources: list[Source]) -> list[list]:
    """[block, first row, end row] runs of consecutive rows of one block, prompt order."""
    pieces: list[list] = []
    for s in sources:
        last = pieces[-1] if pieces else None
        if last is not None and last[0] is s.block and last[2] == s.block_row:
            last[2] += s.n
        else:
            pieces.append([s.block, s.block_row, s.block_row + s.n])
    return pieces


def _placed(sources: list[Source], k: torch.Tensor, v: torch.Tensor, rope: Rope,
            device: torch.device) -> HostImage:  # fmt: skip
    """The image of rows k, v with each row's unit, slot row and re-rotation."""
    rows = torch.tensor([s.n for s in sources])
    start = [0, *torch.cumsum(rows, 0).tolist()]
    unit = torch.repeat_interleave(torch.arange(len(sources)), rows)  # [R]
    first = torch.tensor([[s.slot_row - a, s.delta] for s, a in zip(sources, start, strict=False)])
    slot_row, delta = first[unit].unbind(1)
    slot_row = slot_row + torch.arange(start[-1])
    cos, sin = rerotation(rope, to_device(delta, device))
    return HostImage(k, v, tuple(start), unit, slot_row, cos, sin)


def _home(pieces: list[list]) -> torch.device | None:
    """The CUDA device of the first block there, if any (None: every block on the host)."""
    for b, _, _ in pieces:
        if b.k.device.type == "cuda":
            return b.k.device
    return None


def _cat(parts: list[torch.Tensor], pin: bool, where: torch.device | None = None) -> torch.Tensor:
    """Concatenate along rows on `where` (None: the host); a single whole block already
    there is used as it is (no copy). Parts on either side: one copy each."""
    home = where or torch.device("cpu")
    if len(parts) == 1 and parts[0].is_contiguous() and parts[0].device == home:
        return parts[0]
    shape = list(parts[0].shape)
    shape[1] = sum(p.shape[1] for p in parts)
    out = torch.empty(shape, dtype=parts[0].dtype, pin_memory=pin, device=where)
    if all(p.device == home for p in parts):
        return torch.cat(parts, dim=1, out=out)
    row = 0
    for p in parts:
        out[:, row : row + p.shape[1]].copy_(p, non_blocking=True)
        row += p.shape[1]
    return out
