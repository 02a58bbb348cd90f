"""Selective layer-by-layer prefill of a plan prompt over cached memory KV.

The prompt's tokens (kv/memory_kv.py PromptLayout) are appended to a slot that holds
the frame's prefix. Layer by layer, only the *active* tokens carry hidden states:
they compute their Q/K/V, overwrite their rows of that layer and attend causally to
every row before them, cached or computed. Every other row of the layer is the cached
(re-rotated) KV the loader put there. The active set only shrinks: a token dropped
at layer i is never computed again, so its cached KV serves every later layer.

    layer 0:  all tokens active            (KEEP, CacheBlend)   header + query only (full reuse)
    layer i:  header + query + what the selector kept after layer i - 1

With every token active at every layer this is `GemmaBackbone.forward` over the same
packed step, op for op (`layer_forward`), so its bytes equal full recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from embodied_kv.kernels.packed_attention import bucket
from embodied_kv.kv.arena import KVArena
from embodied_kv.kv.layer_loading import LayerLoader, LoadSchedule, Source
from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.kv.step import PackedStep, Segment, logit_rows, plan_step
from embodied_kv.model.vla import VLA, StepInput


@dataclass
class LayerView:
    """What a selector sees after layer i: the step's tokens and their queries."""

    layer: int
    tokens: list[int]  # prompt token index of each real row of the step
    q: torch.Tensor  # [len(tokens), Hq, D] after RoPE
    hidden: torch.Tensor  # [len(tokens), W] the layer's output (the next layer's input)
    backbone: torch.nn.Module
    kv_len: list[int]  # rows each token read
    arena: KVArena
    slot: int
    row0: int  # slot row of prompt token 0


class Selector(Protocol):
    def initial(self, lay: PromptLayout) -> set[int]:
        """Token indices computed at layer 0."""

    def next(self, view: LayerView, lay: PromptLayout) -> set[int]:
        """Token indices computed at layer view.layer + 1 (a subset of view.tokens)."""


@dataclass
class PrefillStats:
    active: list[int]  # tokens computed per layer
    copied_rows: list[int]  # rows copied per issue point


@torch.no_grad()
def selective_prefill(
    model: VLA,
    arena: KVArena,
    slot: int,
    lay: PromptLayout,
    selector: Selector,
    overlap: bool = True,
) -> tuple[torch.Tensor, PrefillStats]:
    """Append `lay` to `slot` -> (logits [V] after its last token, stats)."""
    backbone = model.backbone
    n = lay.n
    plan = plan_step(arena, [Segment(slot, n, causal=True)])
    x = model.embed_inputs([StepInput(slot, ids=torch.tensor(lay.ids))], plan.n_padded)
    row0 = int(arena.length[0, slot])
    pos0 = int(arena.next_pos[slot])
    sources, units = _sources(lay, row0, pos0)
    tokens = sorted(selector.initial(lay))
    schedule = LoadSchedule(len(backbone.layers), [s.n for s in sources], overlap=overlap)
    loader = LayerLoader(arena, slot, backbone.rope, sources, schedule)
    step = plan if len(tokens) == n else _sub_step(arena, plan, tokens)
    if len(tokens) != n:
        x = _gather(x, list(range(n)), tokens, step.n_padded)
    stats = PrefillStats([], [])
    for i in range(len(backbone.layers)):
        loader.issue(i, _active_units(units, tokens))
        stats.copied_rows.append(sum(sources[c.unit].n for c in schedule.points[-1]))
        loader.wait(i)
        stats.active.append(len(tokens))
        x, q = backbone.layer_forward(i, x, backbone.rope.at(step.position), step, arena)
        if i + 1 == len(backbone.layers):
            break
        m = len(tokens)
        view = LayerView(i, tokens, q[:m], x[:m], backbone, step.kv_len_host[i, :m].tolist(),
                         arena, slot, row0)  # fmt: skip
        keep = sorted(selector.next(view, lay))
        if keep != tokens:
            assert set(keep) <= set(tokens) and n - 1 in keep
            sub = _sub_step(arena, plan, keep)
            x, tokens, step = _gather(x, tokens, keep, sub.n_padded), keep, sub
    arena.length[:, slot] += n
    arena.next_pos[slot] += n
    logits = backbone.logits(backbone.norm(x), step.last_index)[0]
    return logits, stats


def _sources(lay: PromptLayout, row0: int, pos0: int) -> tuple[list[Source], list[range]]:
    """One loader unit per segment with a cached block -> (sources, token range of each)."""
    sources, units = [], []
    for p in lay.placed:
        if p.block is None:
            continue
        for (start, m), (brow, bm) in zip(p.pieces, p.block.spans, strict=True):
            assert m == bm
            delta = (pos0 + start) - (p.block.pos0 + brow)
            sources.append(Source(p.block, brow, row0 + start, m, delta))
            units.append(range(start, start + m))
    return sources, units


def _active_units(units: list[range], tokens: list[int]) -> set[int]:
    """Loader units that need no cache at this layer: every token of them computed."""
    have = set(tokens)
    return {u for u, r in enumerate(units) if all(t in have for t in r)}


def _gather(x: torch.Tensor, tokens: list[int], keep: list[int], n_padded: int) -> torch.Tensor:
    """Rows of `keep` out of x (rows laid out as `tokens`) -> [n_padded, W], zero padding."""
    where = {t: j for j, t in enumerate(tokens)}
    idx = torch.tensor([where[t] for t in keep], device=x.device)
    out = torch.zeros(n_padded, x.shape[1], dtype=x.dtype, device=x.device)
    out[: len(keep)] = x.index_select(0, idx)
    return out


def _sub_step(arena: KVArena, plan: PackedStep, tokens: list[int]) -> PackedStep:
    """The packed step of `tokens` (indices into `plan`'s one causal run) alone: each
    keeps its row, position and reach; padding goes to the scratch slot as in plan_step."""
    m = len(tokens)
    pad = bucket(m) - m
    dev = arena.device
    t = torch.tensor(tokens, device=dev)
    t_host = torch.tensor(tokens)
    j = torch.arange(pad, device=dev)
    n_layers = plan.row.shape[0]
    scratch = torch.full((pad,), arena.scratch_slot, dtype=torch.int64, device=dev)
    row = torch.cat([plan.row[:, t], j.expand(n_layers, pad)], dim=1)
    kv_host = torch.cat(
        [plan.kv_len_host[:, t_host], torch.arange(1, pad + 1).expand(n_layers, pad)], dim=1
    )
    slot = plan.segments[0].slot
    return PackedStep(
        segments=(Segment(slot, m),),
        n_real=m,
        slot=torch.cat([plan.slot[t], scratch]),
        position=torch.cat([plan.position[t], torch.zeros_like(j)]),
        row=row,
        kv_len=kv_host.to(dev),
        kv_len_host=kv_host,
        runs=[(slot, 0, m)],
        last=[m - 1],
        last_index=torch.full((logit_rows(arena),), m - 1, dtype=torch.int64, device=dev),
    )
