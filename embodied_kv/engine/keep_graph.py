"""KEEP's selective prefill replayed from CUDA graphs (the GPU path).

Eager, a KEEP prefill at 40 segments dispatches ~900 torch ops plus a host sync per
layer (kv/recompute.py): on an H100 its launches cost more than full recomputation's
whole packed step. Every shape in it is static once the prompt is laid out:

    layer i computes the header, the query and k_i = min(k_(i-1), ceil(r_i x S)) segments
    (k_0 = S), at most m_i rows = header + query + the k_i longest segments

so the whole prefill (every layer's cached rows placed, the layer, the multi-hop
selection, the narrowing) runs over static buffers without reading a value on the
host. A graph's shape (`GraphShape`) is a set of bounds, and one capture serves every
request within them: the segment count S and k_i are data (padding segments are never
chosen, the top k_i taken by rank among the graph's static top-k), the query is
padded, the rows are bounds. A capture leaves room (`with_room`): up to the next
multiple of SEGMENTS_GRAIN segments, each as long as the longest, and a query up to
QUERY_GRAIN tokens longer, so a memory that grows and queries of other lengths replay
it; a request takes the smallest graph kept that holds it. Inside the graph, per layer:

    1. the layer's cached rows of every segment, keys re-rotated, into the slot (the
       rows computed at this layer are overwritten by step 2, as eager never copies them)
    2. `layer_forward` over the m_i rows (padding rows write the scratch slot)
    3. where the ratios can narrow (r_(i+1) under every earlier r): the query rows' and
       every segment's last token's attention to each segment (`read_attention`), the
       top k_(i+1) among the segments computed at layer i, `hops` re-scorings (as
       `KeepSelector`, means as masked fp64 sums); the kept tokens sorted to the front
       of the next layer's m_(i+1) rows, the rest padding

The memory image lives on the device here (the request's cached rows in prompt order,
`ImageCache(device=...)`: an update copies only the blocks it replaced), so a layer's
placement is a device gather, not a host copy: at pi05 shapes 40 segments of memory
are ~30 MB, small beside the GPU. The host work per request is the layout, one copy of
the index tensors and the image's changed blocks.

The same selection as `KeepSelector` in the same order; its softmax runs over every
row of the slot (the eager one stops at the prompt's end), so scores agree to fp32
rounding, not in bytes. With every ratio 1.0 nothing is selected and the prefill is
full recomputation's layers over the graph's packed step (bytes, tested).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from embodied_kv.engine.graphs import GraphRunner, StaticStep
from embodied_kv.kernels.packed_attention import ROW_BUCKET, bucket, row_bucket
from embodied_kv.kv.host_image import ImageCache
from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.kv.memory_methods import keep
from embodied_kv.kv.recompute import PrefillStats, source_list
from embodied_kv.kv.selectors import (
    KeepConfig,
    ranked,
    read_attention,
    segment_bounds,
    segment_sums,
    segment_tokens,
)
from embodied_kv.model.vla import VLA, StepInput
from embodied_kv.storage.arena import KVArena
from embodied_kv.storage.step import Segment, logit_rows, plan_step, to_device_as_one

ROWS_GRAIN = 32  # a layer's row bound is rounded up to this: fewer shapes, fewer captures
SEGMENTS_GRAIN = 8  # a capture holds up to the next multiple of this many segments
QUERY_GRAIN = 16  # and a query up to the next multiple of this many tokens
MAX_SHAPES = 8  # graphs kept (least recently used dropped)


@dataclass(frozen=True)
class GraphShape:
    """What a graph freezes, as bounds: a capture serves every request whose own shape
    (`graph_shape`) they hold (`holds`)."""

    n_pad: int  # prompt tokens, padded (the first layer's rows)
    segments: int  # S
    query: int  # query tokens
    image_rows: int  # cached rows, padded
    keep: tuple[int, ...]  # segments computed per layer (k_0 = S)
    rows: tuple[int, ...]  # rows computed per layer (m_0 = n_pad)

    def holds(self, need: GraphShape) -> bool:
        scalars = ("n_pad", "segments", "query", "image_rows")
        return all(getattr(self, f) >= getattr(need, f) for f in scalars) and all(
            a >= b for a, b in zip(self.keep + self.rows, need.keep + need.rows, strict=True))


def graph_shape(lay: PromptLayout, cfg: KeepConfig, num_layers: int,
                grain: int = ROW_BUCKET) -> GraphShape:  # fmt: skip
    """The request's own shape: its k_i and the rows its k_i longest segments need; the
    prompt padded to a multiple of `grain` (the arena's row bucket: 8 on CUDA, the host's
    ROW_BUCKET on the CPU, as plan_step pads)."""
    lengths = [n for _, n in lay.segments()]
    fixed = lay.n - sum(lengths)
    n_pad = bucket(lay.n, grain)
    return _shape(lengths, fixed, lay.n - lay.query_start, n_pad, cfg, num_layers)


def with_room(lay: PromptLayout, cfg: KeepConfig, num_layers: int, max_len: int,
              grain: int = ROW_BUCKET) -> GraphShape:  # fmt: skip
    """The shape to capture for `lay`: room for up to the next multiple of SEGMENTS_GRAIN
    segments (the new ones as long as the longest) and a query up to the next multiple of
    QUERY_GRAIN tokens, so the requests that follow a growing memory replay it. The
    request's own shape where that room would not fit the arena's slots (`max_len`)."""
    lengths = [n for _, n in lay.segments()]
    query = lay.n - lay.query_start
    more = bucket(len(lengths) + 1, SEGMENTS_GRAIN) - len(lengths)
    q_room = bucket(query + 1, QUERY_GRAIN)
    longest = max(lengths)
    n = lay.n + more * longest + q_room - query
    fixed = lay.n - sum(lengths) + q_room - query
    room = _shape(lengths + [longest] * more, fixed, q_room,
                  bucket(bucket(n, ROWS_GRAIN), grain), cfg, num_layers)  # fmt: skip
    if room.n_pad <= max_len and room.image_rows <= max_len:
        return room
    return graph_shape(lay, cfg, num_layers, grain)


def _shape(lengths: list[int], fixed: int, query: int, n_pad: int, cfg: KeepConfig,
           num_layers: int) -> GraphShape:  # fmt: skip
    s, lengths = len(lengths), sorted(lengths, reverse=True)
    keep, rows = [s], [n_pad]
    for i in range(1, num_layers):
        keep.append(min(keep[-1], math.ceil(cfg.ratio(i, num_layers) * s - 1e-9)))
        bound = fixed + sum(lengths[: keep[-1]])
        rows.append(rows[-1] if keep[-1] == keep[-2] else min(n_pad, bucket(bound, ROWS_GRAIN)))
    image = bucket(sum(lengths), ROWS_GRAIN)
    return GraphShape(n_pad, s, query, image, tuple(keep), tuple(rows))


def narrowing(cfg: KeepConfig, num_layers: int) -> tuple[bool, ...]:
    """Per layer i: whether the set computed can shrink after it, for some segment count
    (r_(i+1) under r_0..r_i). The graph selects after these layers only."""
    r = [cfg.ratio(i, num_layers) for i in range(num_layers)]
    return tuple(i + 1 < num_layers and r[i + 1] < min(r[: i + 1]) for i in range(num_layers))


class _Buffers:
    """A shape's static inputs: the prompt's packed step, its segments, the image."""

    def __init__(self, model: VLA, arena: KVArena, shape: GraphShape):
        dev, s = arena.device, shape.segments
        self.step = StaticStep(model, arena, shape.n_pad)
        i64 = {"dtype": torch.int64, "device": dev}
        self.owner_of_token = torch.full((shape.n_pad,), s + 1, **i64)  # S: fixed, S+1: pad
        self.seg_last = torch.zeros(s, **i64)  # prompt token of each segment's last token
        # the request's k_0 .. k_(L-1), then its segments S, query tokens, query_start, n
        self.meta = torch.zeros(len(shape.keep) + 4, **i64)
        self.slot = torch.zeros(1, **i64)  # the request's slot
        r = shape.image_rows
        self.img_bounds = torch.zeros(s + 1, **i64)  # segment j: image rows [j] to [j + 1]
        self.img_slot = torch.full((r,), arena.scratch_slot, **i64)
        # slot row of each image row, per layer (a VL-Cache-compressed prefix: each layer's
        # prompt starts at its own row count)
        self.img_row = torch.arange(r, **i64).expand(arena.spec.num_layers, r).clone()  # [L, r]
        spec = arena.spec
        shape_kv = (spec.num_layers, r, spec.kv_heads, spec.head_dim)
        self.img_k = torch.zeros(shape_kv, dtype=arena.k.dtype, device=dev)
        self.img_v = torch.zeros(shape_kv, dtype=arena.v.dtype, device=dev)
        self.cos = torch.ones(r, 1, spec.head_dim, device=dev)  # re-rotation per image row
        self.sin = torch.zeros(r, 1, spec.head_dim, device=dev)
        self.computed = torch.ones(len(shape.keep), s, dtype=torch.bool, device=dev)  # output
        self.replay = None
        self.logits: torch.Tensor | None = None  # [logit_rows, V] the graph's output


class GraphKeep:
    """The `keep` method (kv/memory_methods.py) replayed from graphs: `prefill` has the
    methods' interface; eager KEEP where a segment has no cached block, the memory is
    empty or the request is not over the runner's arena and model. A slot whose layers
    hold different row counts (VL-Cache) replays the same graph: the image's slot rows
    are per layer."""

    grouped, cached = True, True

    def __init__(self, runner: GraphRunner, cfg: KeepConfig | None = None,
                 name: str = "keep-graphs", max_shapes: int = MAX_SHAPES):  # fmt: skip
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes}: keep at least one graph")
        self.runner, self.cfg, self.name = runner, cfg or KeepConfig(), name
        self.max_shapes = max_shapes
        self.images = ImageCache(device=runner.arena.device)
        self.graphs: dict[GraphShape, _Buffers] = {}  # least recently used first
        self.last: tuple[PromptLayout, _Buffers] | None = None  # None: the last ran eagerly
        self.failed: str | None = None  # why graphs were given up (a capture failed)
        self.eager = keep(self.cfg)

    @torch.no_grad()
    def prefill(self, model: VLA, arena: KVArena, slot: int, lay: PromptLayout,
                frame: int = 0) -> torch.Tensor:  # fmt: skip
        graphable = arena is self.runner.arena and model.backbone is self.runner.model.backbone
        if self.failed or not graphable or any(p.block is None for p in lay.placed) or (
            not lay.segments()
        ):
            out = self.eager.prefill(model, arena, slot, lay, frame)  # nothing to graph
            self.last = None
            return out
        layers = len(model.backbone.layers)
        grain = row_bucket(arena.device)  # 8 on CUDA: not the host CPU's GEMM probe
        need = graph_shape(lay, self.cfg, layers, grain)
        kept = [s for s in self.graphs if s.holds(need)]
        shape = min(kept, key=lambda s: (s.n_pad, sum(s.rows), s.image_rows), default=None)
        shape = shape or with_room(lay, self.cfg, layers, arena.spec.max_len, grain)
        buf = self.graphs.get(shape) or _Buffers(model, arena, shape)
        self._load(model, arena, slot, lay, need, shape, buf)
        if buf.replay is None:
            try:
                buf.replay, buf.logits = self.runner.graph_of(
                    lambda: self._forward(model, shape, buf))  # fmt: skip
            except RuntimeError as e:  # a capture the device refused: eager from now on
                if self.runner.mode == "emulate":
                    raise  # emulation refuses a host read: a bug to surface, not to route round
                self.failed = f"graph capture failed, eager KEEP from now on: {e}"
                warnings.warn(self.failed, stacklevel=2)
                return self.prefill(model, arena, slot, lay, frame)
        self.graphs.pop(shape, None)
        self.graphs[shape] = buf  # the most recently used last
        while len(self.graphs) > self.max_shapes:  # its graph and buffers go with it
            self.graphs.pop(next(iter(self.graphs)))
        buf.replay()
        self.runner.replays += 1
        arena.length[:, slot] += lay.n
        arena.next_pos[slot] += lay.n
        self.last = (lay, buf)
        return buf.logits[0].clone()

    @property
    def stats(self) -> PrefillStats | None:
        """The last prefill's tokens computed per layer (read back from the graph's output;
        outside the timed prefill where a caller reads it afterwards)."""
        if self.last is None:
            return self.eager.stats
        lay, buf = self.last
        spans = torch.tensor(lay.segments(), dtype=torch.int64).view(-1, 2)
        fixed = lay.n - int(spans[:, 1].sum())
        per_layer = (buf.computed.cpu()[:, : len(spans)] * spans[:, 1]).sum(1)  # [L]
        return PrefillStats([fixed + int(t) for t in per_layer], [])

    def _load(self, model: VLA, arena: KVArena, slot: int, lay: PromptLayout,
              need: GraphShape, shape: GraphShape, buf: _Buffers) -> None:  # fmt: skip
        """The request's values (its own shape `need`) into the static buffers of the
        graph's `shape` (device copies only)."""
        plan = plan_step(arena, [Segment(slot, lay.n, causal=True)], shape.n_pad)
        buf.step.load(plan, model.embed_inputs([StepInput(slot, ids=torch.tensor(lay.ids))],
                                               shape.n_pad))  # fmt: skip
        rows0 = arena.length[:, slot].clone()  # [L] each layer's row of prompt token 0
        row0, pos0 = int(rows0[0]), int(arena.next_pos[slot])
        sources = source_list(lay, row0, pos0)  # layer 0's slot rows
        image = self.images.pack(sources, model.backbone.rope, arena.device)
        r, s, s_pad = image.slot_row.shape[0], need.segments, shape.segments
        tokens, seg, last = segment_tokens(lay)
        owner = torch.full((shape.n_pad,), s_pad + 1, dtype=torch.int64)
        owner[: lay.n] = s_pad
        owner[tokens] = seg
        pad = shape.image_rows - r  # image rows past the request's: the scratch slot
        img_bounds = segment_bounds(owner[image.slot_row - row0], s_pad)  # padding: empty
        img_slot = torch.cat([torch.full((r,), slot), torch.full((pad,), arena.scratch_slot)])
        img_row = torch.cat([image.slot_row[None, :] + (rows0 - row0)[:, None],
                             torch.arange(r, shape.image_rows).expand(len(rows0), pad)], 1)
        meta = torch.tensor([*need.keep, s, need.query, lay.query_start, lay.n])
        last = torch.nn.functional.pad(last, (0, s_pad - s), value=lay.n - 1)  # padding: any
        parts = [owner, last, meta, img_bounds, img_slot, img_row, torch.tensor([slot])]
        for dst, src in zip((buf.owner_of_token, buf.seg_last, buf.meta, buf.img_bounds,
                             buf.img_slot, buf.img_row, buf.slot),
                            to_device_as_one(parts, arena.device), strict=True):  # fmt: skip
            dst.copy_(src, non_blocking=True)
        buf.img_k[:, :r].copy_(image.k, non_blocking=True)
        buf.img_v[:, :r].copy_(image.v, non_blocking=True)
        buf.cos[:r].copy_(image.cos)
        buf.sin[:r].copy_(image.sin)

    def _forward(self, model: VLA, shape: GraphShape, buf: _Buffers) -> torch.Tensor:
        """The captured function: every layer over the static buffers -> logits."""
        backbone, arena = model.backbone, self.runner.arena
        rope, st = backbone.rope, buf.step
        step, x = st.plan, st.x
        s, dev, layers = shape.segments, x.device, len(shape.keep)
        computed = torch.arange(s, device=dev) < buf.meta[layers]  # segments computed now
        j = torch.arange(shape.query, device=dev)  # the query, padded: the last token again
        query_on = (j < buf.meta[layers + 1]).double()
        query = torch.minimum(buf.meta[layers + 2] + j, buf.meta[layers + 3] - 1)
        row_of = torch.arange(shape.n_pad, device=dev)  # each prompt token's row of x
        cos_sin = rope.at(step.position)
        narrows = narrowing(self.cfg, layers)
        for i in range(layers):
            k = rope.rotate(buf.img_k[i], (buf.cos, buf.sin))
            arena.k[i].index_put_((buf.img_slot, buf.img_row[i]), k.to(arena.k.dtype))
            arena.v[i].index_put_((buf.img_slot, buf.img_row[i]), buf.img_v[i])
            x, q = backbone.layer_forward(i, x, cos_sin, step, arena)
            if not narrows[i]:
                continue
            computed = self._select(i, q, step, row_of, (query, query_on), computed, shape,
                                    buf, arena)  # fmt: skip
            buf.computed[i + 1 :].copy_(computed.expand(layers - i - 1, s))
            keep_seg = torch.cat([computed, torch.ones(1, dtype=torch.bool, device=dev),
                                  torch.zeros(1, dtype=torch.bool, device=dev)])  # fmt: skip
            keep = keep_seg[buf.owner_of_token]  # [n_pad]: fixed, chosen segments
            step, x, row_of = _narrow(st.plan, keep, row_of, x, shape.rows[i + 1], arena)
            cos_sin = rope.at(step.position)
        return backbone.logits(backbone.norm(x), step.last_index)

    def _select(self, i: int, q: torch.Tensor, step, row_of: torch.Tensor, query,
                computed: torch.Tensor, shape: GraphShape, buf: _Buffers,
                arena: KVArena) -> torch.Tensor:  # fmt: skip
        """KeepSelector's multi-hop choice on the device -> [S] bool: computed at i + 1.
        The request's k_(i+1) is data: the graph ranks its static top-k bound and keeps
        the first k (padding and segments no longer computed rank last). `query`: the
        query's prompt tokens, padded, and their weights (1: real, 0: padding)."""
        bound = shape.keep[i + 1]
        if bound == 0:  # header and query alone from here on
            return torch.zeros_like(computed)
        query, on = query
        src = torch.cat([row_of[query], row_of[buf.seg_last]])  # rows of q
        lens = step.kv_len[i].index_select(0, src)
        keys = arena.k[i].index_select(0, buf.slot)[0]  # [T, Hkv, D] the request's slot
        probs = read_attention(q.index_select(0, src), keys, lens)  # [m, T]
        mass = segment_sums(probs.index_select(1, buf.img_row[i]), buf.img_bounds).double()
        q_mass, rows = (mass[: shape.query] * on[:, None]).sum(0) / on.sum(), mass[shape.query :]
        k = buf.meta[i + 1]
        first_k = torch.arange(bound, device=k.device) < k  # [bound] ranks kept
        off = torch.full_like(q_mass, float("-inf"))
        chosen = ranked(torch.where(computed, q_mass, off), bound)
        for _ in range(self.cfg.hops):
            set_mass = (rows.index_select(0, chosen) * first_k[:, None]).sum(0) / k.clamp(min=1)
            chosen = ranked(torch.where(computed, q_mass + set_mass, off), bound)
        return torch.zeros_like(computed).index_put_((chosen,), first_k)


def _narrow(full, keep: torch.Tensor, row_of: torch.Tensor, x: torch.Tensor, m: int,
            arena: KVArena):  # fmt: skip
    """The kept tokens first (prompt order), then padding to m rows on the scratch slot:
    -> (the next layer's step, its x [m, W], each prompt token's row of it). Padding row
    j writes scratch row j - count and reads up to it: the bound m is set by the longest
    segments, so there can be hundreds of padding rows, and at row j each would read j."""
    order = torch.sort((~keep).to(torch.uint8), stable=True).indices[:m]  # [m] prompt tokens
    count = keep.sum()
    j = torch.arange(m, device=x.device)
    real = j < count  # [m]
    scratch = torch.full_like(j, arena.scratch_slot)
    step = type(full)(
        segments=full.segments, n_real=m,
        slot=torch.where(real, full.slot[order], scratch),
        position=torch.where(real, full.position[order], 0),
        row=torch.where(real, full.row[:, order], j - count),
        kv_len=torch.where(real, full.kv_len[:, order], j - count + 1),
        kv_len_host=None, runs=None, last=[],
        last_index=(count - 1).expand(logit_rows(arena)),
    )  # fmt: skip
    x = torch.where(real[:, None], x.index_select(0, row_of[order]), 0)
    return step, x, torch.zeros_like(row_of).index_copy_(0, order, j)

