"""Memory blocks over the model: computing a unit's KV, re-rotating cached keys, and
laying out a plan prompt whose memory comes from blocks.

A block is computed in a work slot after a fixed anchor (the memory header, whose
rows are dropped), at positions len(anchor) onward, so every block saw the same short
context. A plan request's rows after the frame's prefix P:

    row:   P ........ P+h ......................................... P+n
           | header  | unit 1 rows | unit 2 rows | ... | query      |
           computed    cached (re-rotated by their delta), or recomputed  computed

Re-rotation: K is stored after RoPE at position p; at position p + d it is
k * cos(d theta) + rotate_half(k) * sin(d theta) (V is unchanged): the model's own
rotation (`Rope.rotate`) by the tables at |d|, sin negated for d < 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kv.memory import HEADER, KVBlock, Unit, piece, query_suffix
from embodied_kv.model.layers import Rope
from embodied_kv.model.vla import VLA, StepInput
from embodied_kv.storage.arena import KVArena


@torch.no_grad()
def rerotate(rope: Rope, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """k [n, H, D] after RoPE at positions p -> the same keys at p + delta ([n] int64)."""
    return rope.rotate(k, rerotation(rope, delta))


def rerotation(rope: Rope, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables `rope.rotate` takes to move keys by delta [n] -> (cos, sin) [n, 1, D]."""
    d = delta.to(rope.cos.device)
    cos, sin = rope.at(d.abs())
    return cos, torch.where((d < 0)[:, None, None], -sin, sin)


def encode(model: VLA, text: str) -> list[int]:
    return model.tokenizer.encode(text, bos=False)


@torch.no_grad()
def compute_block(model: VLA, arena: KVArena, work_slot: int, texts: list[str],
                  runner=None) -> KVBlock:  # fmt: skip
    """KV of the segments `texts`, in order, computed together after the anchor (the
    memory header) in `work_slot`, which is left empty -> a block on the arena's device
    (a device copy: no host sync; the memory moves it to the host tier past its budget,
    SegmentMemory.refresh). `runner` (engine/graphs.py GraphRunner over this arena): the
    step replayed from its packed-step graph (eager where no bucket holds it)."""
    anchor = encode(model, HEADER)
    pieces = [encode(model, piece(t)) for t in texts]
    ids = anchor + [i for p in pieces for i in p]
    if arena.slot_len(work_slot):
        raise ValueError(f"work slot {work_slot} is not empty ({arena.slot_len(work_slot)} rows)")
    try:
        step = [StepInput(work_slot, ids=torch.tensor(ids))]
        if runner is None or runner.arena is not arena or runner.step(step) is None:
            model.step(arena, step)
        a, n = len(anchor), len(ids)
        k = arena.k[:, work_slot, a:n].clone()
        v = arena.v[:, work_slot, a:n].clone()
    finally:
        arena.clear(work_slot)
    spans, start = [], 0
    for p in pieces:
        spans.append((start, len(p)))
        start += len(p)
    return KVBlock(k, v, len(anchor), tuple(spans))


@dataclass(frozen=True)
class Placed:
    """One unit in a plan prompt: its block, and where its rows start in the prompt."""

    unit: Unit
    block: KVBlock | None  # None: no cache (the method computes it)
    start: int  # token index in the prompt's ids (0 = the header's first token)
    n: int
    pieces: tuple[tuple[int, int], ...]  # (token index, tokens) of each segment


@dataclass(frozen=True)
class PromptLayout:
    """The ids a plan request appends after the frame's prefix, and what is where."""

    ids: tuple[int, ...]
    placed: tuple[Placed, ...]
    header: int  # tokens of the header
    query_start: int  # token index of the query's first token

    @property
    def n(self) -> int:
        return len(self.ids)

    def segments(self) -> list[tuple[int, int]]:
        """(token index, tokens) of every segment, in prompt order: the importance units."""
        return [p for u in self.placed for p in u.pieces]

    def fixed(self) -> list[int]:
        """Token indices always computed fresh: the header and the query."""
        return [*range(self.header), *range(self.query_start, self.n)]


def layout(model: VLA, units: list[Unit], blocks: dict[str, KVBlock], goal: str) -> PromptLayout:
    """Token ids of header + units + query (each piece tokenised alone, so a block's ids
    are the prompt's), with every unit's block when the memory has one."""
    ids = encode(model, HEADER)
    header = len(ids)
    placed = []
    for unit in units:
        start, pieces = len(ids), []
        for text in unit.texts:
            p = encode(model, piece(text))
            pieces.append((len(ids), len(p)))
            ids += p
        block = blocks.get(unit.key)
        if block is not None and block.rows != len(ids) - start:
            raise ValueError(f"block {unit.key} has {block.rows} rows, its text {len(ids) - start}")
        placed.append(Placed(unit, block, start, len(ids) - start, tuple(pieces)))
    query_start = len(ids)
    ids += encode(model, query_suffix(goal))
    return PromptLayout(tuple(ids), tuple(placed), header, query_start)
