"""Planning one packed step: which rows each new token writes and which it reads.

A step is a list of segments, each some new tokens of one slot. Laid out flat:

    token:   | s2 s2 s2 s2 | s0 | s5 | pad pad ... pad |
    segment: | prefill(4)  | dec| dec| scratch slot    |   padded once, to a row_bucket multiple

Token j of a segment of slot s (rows already valid: len) writes row len + j and reads
rows [0, len + j + 1) if the segment is causal, [0, len + n) if bidirectional (the
pi0.5 prefix attends to itself in both directions). Positions continue from
next_pos[s]. The plan is built on the host from the arena's host-side lengths and
copied to the device from pinned memory without blocking (no host sync in a step).

Logits are computed for one row per segment (its last token), gathered at
`last_index`: a fixed count of rows, `logit_rows(arena)`, the same in every step, so a
row's logits do not depend on how many segments share the step (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels.packed_attention import Run, bucket, row_bucket
from embodied_kv.storage.arena import KVArena


@dataclass(frozen=True)
class Segment:
    slot: int
    n: int  # new tokens of this slot in this step
    causal: bool = True  # False: the n tokens see each other (pi0.5 prefix)


@dataclass
class PackedStep:
    segments: tuple[Segment, ...]
    n_real: int  # tokens before padding
    slot: torch.Tensor  # [Np] int64, device
    position: torch.Tensor  # [Np] int64, device: RoPE positions
    row: torch.Tensor  # [L, Np] int64, device: where each token's K/V goes
    kv_len: torch.Tensor  # [L, Np] int64, device: rows each token reads
    kv_len_host: torch.Tensor | None  # [L, Np] int64, host copy; None inside a graph
    runs: list[Run] | None  # contiguous runs of one slot (host); the padding is in none: its
    # attention output is never read, so the reference skips it. None inside a graph
    last: list[int]  # index of each segment's last token (host)
    last_index: torch.Tensor  # [logit_rows] int64, device: `last`, padded by repeating

    @property
    def n_padded(self) -> int:
        return int(self.slot.shape[0])


def logit_rows(arena: KVArena) -> int:
    """Rows of every step's LM-head GEMM: one per possible segment (a step's slots are
    distinct), bucketed, so eager steps and graphs run the same GEMM shape."""
    return bucket(arena.spec.num_slots, row_bucket(arena.device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> `device` without a host sync: through pinned memory (torch's caching
    host allocator keeps it alive until the copy is done) and a non-blocking copy."""
    if t.device == device:  # (a no-op `.to` still costs a dispatch: a CPU decode step is small)
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def plan_step(
    arena: KVArena, segments: list[Segment] | tuple[Segment, ...], pad_to: int = 0
) -> PackedStep:
    """Lay out a step, padded to `pad_to` tokens (a graph's bucket) or the next multiple of
    the arena's `row_bucket` (the host's ROW_BUCKET on the CPU, 8 on CUDA); ValueError if
    a slot is repeated, unknown or would overflow."""
    if not segments:
        raise ValueError("a packed step needs at least one segment")
    spec = arena.spec
    seen = set()
    for seg in segments:
        if seg.slot in seen or not 0 <= seg.slot < spec.num_slots or seg.n < 1:
            raise ValueError(f"bad segment {seg} (slots must be distinct, in range, n >= 1)")
        seen.add(seg.slot)
    slots = [seg.slot for seg in segments]
    held = arena.length[:, slots].amax(0).tolist()  # arena.slot_len of each, in one op
    for seg, h in zip(segments, held, strict=True):
        if h + seg.n > spec.max_len:
            raise ValueError(
                f"slot {seg.slot} holds {h} rows; {seg.n} more exceed max_len={spec.max_len}"
            )
    n_real = sum(s.n for s in segments)
    n_pad = max(bucket(n_real, row_bucket(arena.device)), pad_to)
    if n_pad - n_real > spec.max_len:
        raise ValueError(
            f"padding {n_pad - n_real} tokens exceeds the scratch slot ({spec.max_len})"
        )
    # Per token, built as host lists then one tensor (a decode step is small and
    # Python-bound): its slot, index j in its segment, rows it reads past the slot's
    # length, and position. Padding: scratch slot (length 0), reads rows [0, j + 1).
    tok_slot, tok_j, tok_reach, tok_pos = [], [], [], []
    runs, last, start = [], [], 0
    for seg, p0 in zip(segments, arena.next_pos[slots].tolist(), strict=True):
        tok_slot += [seg.slot] * seg.n
        tok_j += range(seg.n)
        tok_reach += range(1, seg.n + 1) if seg.causal else [seg.n] * seg.n
        tok_pos += range(p0, p0 + seg.n)
        runs.append((seg.slot, start, seg.n))
        start += seg.n
        last.append(start - 1)
    pad = n_pad - n_real
    tok_slot += [arena.scratch_slot] * pad
    tok_j += range(pad)
    tok_reach += range(1, pad + 1)
    tok_pos += [0] * pad
    slot, j, reach, position = torch.tensor([tok_slot, tok_j, tok_reach, tok_pos])  # [Np] each
    base = arena.length[:, slot]  # [L, Np]; the scratch slot's length stays 0 (never committed)
    row = base + j
    kv_len = base + reach
    last_index = torch.tensor(last + [last[-1]] * (logit_rows(arena) - len(last)))
    slot_d, position_d, row_d, kv_len_d, last_d = to_device_as_one(
        [slot, position, row, kv_len, last_index], arena.device
    )
    return PackedStep(
        segments=tuple(segments),
        n_real=n_real,
        slot=slot_d,
        position=position_d,
        row=row_d,
        kv_len=kv_len_d,
        kv_len_host=kv_len,
        runs=runs,
        last=last,
        last_index=last_d,
    )


def to_device_as_one(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors -> `device` in one pinned copy (each a view of it there): a
    plan is five small tensors, and each copy of its own cost a pin and a launch (~50 us
    of host time each on the H100 machine). On the host itself: the tensors as they are."""
    if device.type == "cpu":
        return parts
    return unpack(to_device(torch.cat([p.reshape(-1) for p in parts]), device), parts)


def unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped as `like`, in order (flat is their concatenation)."""
    pieces = flat.split([t.numel() for t in like])
    return [v.view(t.shape) for v, t in zip(pieces, like, strict=True)]


def commit_step(arena: KVArena, step: PackedStep) -> None:
    """Make the rows written by `step` valid (call after the forward pass)."""
    slots = [seg.slot for seg in step.segments]  # distinct (plan_step checked)
    n = torch.tensor([seg.n for seg in step.segments])
    arena.length[:, slots] += n
    arena.next_pos[slots] += n
