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

so the copy engine works about as much at every layer instead of all at once.

The rows come from the request's packed host image (kv/host_image.py). A layer's
copies at one issue point are, per K and V, one range of the image and one gather:

    CUDA   image[layer, lo:hi] --one async copy (pinned)--> staging [hi - lo] on the device
    CPU, or an image on the device (the memory's blocks there)   image[layer, lo:hi] (a view)
    both   rows = staged[index]; keys re-rotated; slot rows <- rows (one index_copy_)

The image's slot rows are layer 0's; a layer whose slot holds a different row count
(VL-Cache compressed the prefix) gets them at `shift[layer]` rows further.

(the range may hold rows of units not copied at that point, e.g. between preloaded
dropped units: staged, never written). The host work per request grows with layers,
not layers x segments. On CUDA this runs on a side stream and the compute of a layer
waits on the event after its last copy; the CPU runs the same ops in line (the tests
exercise this path).
`overlap=False` copies everything before layer 0 (the ablation).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from embodied_kv.kv.host_image import HostImage, Source, pack
from embodied_kv.model.layers import Rope
from embodied_kv.storage.arena import KVArena
from embodied_kv.storage.step import to_device_as_one


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


class LayerLoader:
    """Runs a LoadSchedule: copies rows of the packed image into one slot, keys re-rotated.
    `image`: the sources packed (`pack`), when the caller already has it."""

    def __init__(self, arena: KVArena, slot: int, rope: Rope, sources: list[Source],
                 schedule: LoadSchedule, image: HostImage | None = None,
                 stage: bool | None = None, shift: list[int] | None = None):  # fmt: skip
        """`stage`: copy each range into a device staging buffer before the gather (the
        CUDA path; default: on CUDA, for an image on the host). On the CPU it runs the
        same copies in line, so the tests exercise the CUDA path's indexing. `shift`: per
        layer, rows past the sources' slot rows (default none)."""
        self.arena, self.slot, self.rope, self.schedule = arena, slot, rope, schedule
        self.shift = shift or [0] * schedule.num_layers
        if len(self.shift) != schedule.num_layers:
            raise ValueError(f"{len(self.shift)} shifts for {schedule.num_layers} layers")
        self.image = image if image is not None or not sources else pack(
            sources, rope, arena.device)  # fmt: skip
        self.cuda = arena.device.type == "cuda"
        self.stream = torch.cuda.Stream(arena.device) if self.cuda else None
        self.events: dict[int, torch.cuda.Event] = {}  # layer -> after its last copy
        self.staging: tuple[torch.Tensor, torch.Tensor] | None = None
        on_host = self.image is not None and self.image.k.device.type == "cpu"
        if (self.cuda and on_host if stage is None else stage) and self.image is not None:
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                # one layer of the image, K and V; on CUDA owned by the copy stream
                shape, dtype = self.image.k.shape[1:], self.image.k.dtype
                self.staging = tuple(torch.empty(shape, dtype=dtype, device=arena.device)
                                     for _ in range(2))  # fmt: skip

    def issue(self, i: int, active: set[int]) -> None:
        copies = self.schedule.issue(i, active)
        if not copies:
            return
        by_layer: dict[int, list[int]] = {}  # layer -> units, in issue order
        for c in copies:
            by_layer.setdefault(c.layer, []).append(c.unit)
        if not self.cuda:
            self._copy(by_layer)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.arena.device))
        with torch.cuda.stream(self.stream):
            self._copy(by_layer)
            event = torch.cuda.Event()
            event.record(self.stream)
        for layer in by_layer:  # a later point's event follows the earlier on the stream
            self.events[layer] = event

    def _copy(self, by_layer: dict[int, list[int]]) -> None:
        """Per layer and K/V: one range of the image (on CUDA one async copy to the
        staging buffer), one gather of the units' rows, one indexed write into the slot.
        The indices of every layer of the point reach the device in one copy."""
        img = self.image
        ranges, index = [], []
        for layer, units in by_layer.items():
            lo, hi, rel = img.rows_of(units)
            ranges.append((lo, hi))
            index += [rel, rel + lo, img.slot_row[lo:hi].index_select(0, rel) + self.shift[layer]]
        index = to_device_as_one(index, self.arena.device)
        for j, (layer, (lo, hi)) in enumerate(zip(by_layer, ranges, strict=True)):
            rel, rows, dst = index[3 * j : 3 * j + 3]  # [r] each
            k = self._rows(img.k, 0, layer, lo, hi).index_select(0, rel)  # [r, Hkv, D]
            k = self.rope.rotate(k, (img.cos.index_select(0, rows), img.sin.index_select(0, rows)))
            v = self._rows(img.v, 1, layer, lo, hi).index_select(0, rel)
            self.arena.k[layer, self.slot].index_copy_(0, dst, k)
            self.arena.v[layer, self.slot].index_copy_(0, dst, v)

    def _rows(self, part: torch.Tensor, which: int, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Image rows [lo, hi) of one layer where the gather can read them: on CUDA one
        async copy (pinned) into the staging buffer, on the CPU a view."""
        rows = part[layer, lo:hi]  # [hi - lo, Hkv, D]
        if self.staging is None:
            return rows
        return self.staging[which][: hi - lo].copy_(rows, non_blocking=True)

    def wait(self, i: int) -> None:
        """Before layer i computes: its copies are done (re-rotated as they landed)."""
        if self.cuda and i in self.events:
            torch.cuda.current_stream(self.arena.device).wait_event(self.events.pop(i))
