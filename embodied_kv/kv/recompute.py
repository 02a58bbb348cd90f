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

Token sets cross the selector interface as host masks over the prompt ([n] bool): a
layer's host work is a few tensor ops, one selector sync and one small index copy,
whatever the number of segments.

The slot's layers may hold different row counts (VL-Cache compressed the frame's
prefix, kv/compress.py): prompt token t sits at row `length[l] + t` of layer l, at the
same RoPE position in every layer. The packed step carries a row per layer already; the
loader places a layer's cached rows at that layer's own offset and the selectors read
each layer at its own `row0`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from embodied_kv.kernels.packed_attention import bucket
from embodied_kv.kv.host_image import HostImage, ImageCache, Source, pack
from embodied_kv.kv.layer_loading import LayerLoader, LoadSchedule
from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.model.vla import VLA, StepInput
from embodied_kv.storage.arena import KVArena
from embodied_kv.storage.step import PackedStep, Segment, logit_rows, plan_step, to_device_as_one


@dataclass
class LayerView:
    """What a selector sees after layer i: the step's tokens and their queries."""

    layer: int
    tokens: torch.Tensor  # [m] int64 host: prompt token index of each real row, ascending
    q: torch.Tensor  # [m, Hq, D] after RoPE
    hidden: torch.Tensor  # [m, W] the layer's output (the next layer's input)
    backbone: torch.nn.Module
    kv_len: torch.Tensor  # [m] int64 host: rows each token read
    arena: KVArena
    slot: int
    row0: int  # this layer's slot row of prompt token 0
    image: HostImage | None  # the cached rows placed (None: the prompt has no block)


class Selector(Protocol):
    def initial(self, lay: PromptLayout) -> torch.Tensor:
        """[lay.n] bool host: the tokens computed at layer 0."""

    def next(self, view: LayerView, lay: PromptLayout) -> torch.Tensor:
        """[lay.n] bool host: the tokens computed at layer view.layer + 1 (a subset of
        view.tokens, the last token among them)."""


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
    images: ImageCache | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Append `lay` to `slot` -> (logits [V] after its last token, stats). `images`: the
    caller's image of its previous request, updated instead of packed anew."""
    backbone = model.backbone
    n, num_layers = lay.n, len(backbone.layers)
    plan = plan_step(arena, [Segment(slot, n, causal=True)])
    x = model.embed_inputs([StepInput(slot, ids=torch.tensor(lay.ids))], plan.n_padded)
    rows0 = arena.length[:, slot].tolist()  # [L] each layer's row of prompt token 0
    pos0 = int(arena.next_pos[slot])
    sources = source_list(lay, rows0[0], pos0)  # slot rows of layer 0; others: + shift
    image = (images.pack if images else pack)(sources, backbone.rope, arena.device)
    schedule = LoadSchedule(num_layers, [s.n for s in sources], overlap=overlap)
    shift = [r - rows0[0] for r in rows0]
    loader = LayerLoader(arena, slot, backbone.rope, sources, schedule, image, shift=shift)
    try:
        logits, stats = _layers(model, arena, slot, lay, selector, plan, x, loader, image,
                                rows0)  # fmt: skip
    finally:
        if images:  # after every read of the image, also when a layer failed mid-way
            images.fence(arena.device, getattr(loader, "stream", None))
    return logits, stats


def _layers(model: VLA, arena: KVArena, slot: int, lay: PromptLayout, selector: Selector,
            plan: PackedStep, x: torch.Tensor, loader: LayerLoader, image: HostImage | None,
            rows0: list[int]) -> tuple[torch.Tensor, PrefillStats]:  # fmt: skip
    """The layer loop: compute the active tokens, load the rest, narrow with depth.
    `rows0`: each layer's slot row of prompt token 0."""
    backbone = model.backbone
    n, num_layers = lay.n, len(backbone.layers)
    schedule = loader.schedule
    image_token = image.slot_row - rows0[0] if image is not None else None  # [R] host
    active = selector.initial(lay)  # [n] bool host: the rows of x and of `step`
    step = plan
    if not active.all():
        step, x = _narrow(arena, plan, x, torch.ones_like(active), active)
    tokens = active.nonzero().view(-1)
    cos_sin = backbone.rope.at(step.position)
    stats = PrefillStats([], [])
    for i in range(num_layers):
        loader.issue(i, _computed_units(image, image_token, active))
        stats.copied_rows.append(sum(schedule.rows[c.unit] for c in schedule.points[-1]))
        loader.wait(i)
        stats.active.append(len(tokens))
        x, q = backbone.layer_forward(i, x, cos_sin, step, arena)
        if i + 1 == num_layers:
            break
        m = len(tokens)
        view = LayerView(i, tokens, q[:m], x[:m], backbone, step.kv_len_host[i, :m], arena,
                         slot, rows0[i], image)  # fmt: skip
        keep = selector.next(view, lay)
        if not torch.equal(keep, active):
            assert not (keep & ~active).any() and keep[n - 1]
            step, x = _narrow(arena, plan, x, active, keep)
            active, tokens = keep, keep.nonzero().view(-1)
            cos_sin = backbone.rope.at(step.position)
    arena.length[:, slot] += n
    arena.next_pos[slot] += n
    logits = backbone.logits(backbone.norm(x), step.last_index)[0]
    return logits, stats


def source_list(lay: PromptLayout, row0: int, pos0: int) -> list[Source]:
    """One loader unit per segment with a cached block, in prompt order; `row0`: the slot
    row of prompt token 0 (in layer 0: the loader adds each layer's shift)."""
    sources = []
    for p in lay.placed:
        if p.block is None:
            continue
        for (start, m), (brow, bm) in zip(p.pieces, p.block.spans, strict=True):
            assert m == bm
            delta = (pos0 + start) - (p.block.pos0 + brow)
            sources.append(Source(p.block, brow, row0 + start, m, delta))
    return sources


def _computed_units(image: HostImage | None, token: torch.Tensor | None,
                    active: torch.Tensor) -> set[int]:  # fmt: skip
    """Loader units that need no cache at this layer: every token of them computed."""
    if image is None:
        return set()
    cached = set(image.unit[~active[token]].unique().tolist())
    return set(range(len(image.start) - 1)) - cached


def _narrow(arena: KVArena, plan: PackedStep, x: torch.Tensor, active: torch.Tensor,
            keep: torch.Tensor) -> tuple[PackedStep, torch.Tensor]:  # fmt: skip
    """The packed step of the tokens `keep` ([n] bool, a subset of `active`) alone, and
    their rows of x (laid out as `active`) -> (step, x [n_padded, W], zero padding).
    Each token keeps its row, position and reach; padding goes to the scratch slot as in
    plan_step. The host indices reach the device in one copy."""
    t_host = keep.nonzero().view(-1)  # [m] prompt token indices
    m = len(t_host)
    pad = bucket(m) - m
    n_layers = plan.row.shape[0]
    kv_host = torch.cat(
        [plan.kv_len_host[:, t_host], torch.arange(1, pad + 1).expand(n_layers, pad)], dim=1
    )
    where = (active.cumsum(0) - 1)[t_host]  # [m] each token's row of x
    t, where, kv_len = to_device_as_one([t_host, where, kv_host], arena.device)
    dev = arena.device
    j = torch.arange(pad, device=dev)
    scratch = torch.full((pad,), arena.scratch_slot, dtype=torch.int64, device=dev)
    slot = plan.segments[0].slot
    step = PackedStep(
        segments=(Segment(slot, m),),
        n_real=m,
        slot=torch.cat([plan.slot[t], scratch]),
        position=torch.cat([plan.position[t], torch.zeros_like(j)]),
        row=torch.cat([plan.row[:, t], j.expand(n_layers, pad)], dim=1),
        kv_len=kv_len,
        kv_len_host=kv_host,
        runs=[(slot, 0, m)],
        last=[m - 1],
        last_index=torch.full((logit_rows(arena),), m - 1, dtype=torch.int64, device=dev),
    )
    out = torch.zeros(step.n_padded, x.shape[1], dtype=x.dtype, device=x.device)
    out[:m] = x.index_select(0, where)
    return step, out
