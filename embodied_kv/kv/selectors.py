"""Which prompt tokens the selective prefill recomputes at each layer (kv/recompute.py).

* `KeepSelector` (KEEP's multi-hop recomputation, segment granularity): after layer i
  the query's attention to each still-active segment is its initial importance; take
  the top k = ceil(r_{i+1} x segments); re-score every candidate by the query's
  attention plus the mean attention from that set (each segment through its last
  token); repeat until the set is stable (at most `hops` times). `hops=0` is the
  one-hop ablation.
* `CacheBlendSelector` (token level): the ~15 % memory tokens whose V at layer 1
  deviates most from their cached V are computed from layer 1 on; the rest use the cache.
* `FixedSelector`: a fixed set at every layer (full reuse: header + query only).

Token sets are host masks over the prompt ([n] bool, kv/recompute.py). A prompt's
segments become index tensors once per request (`SegmentIndex`), so a layer's
selection is a fixed number of tensor ops (segment sums, top-k on the device) and one
sync for the answer, whatever the number of segments. Segment sums are differences of
an fp64 running sum over each segment's columns (`segment_sums`), not `index_add_`,
whose atomics on CUDA add in a different order each run: the same request chooses the
same segments on every run, in eager mode and from a graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.kv.recompute import LayerView
from embodied_kv.storage.step import to_device, to_device_as_one


@dataclass(frozen=True)
class KeepConfig:
    # defaults from `bench keep --sweep` (400 requests at 40 segments, the trained world
    # model; docs/keep.md): (0.4, 0.1) gave full recomputation's answer as often as the
    # former (0.5, 0.2) and as many two-hop answers right, computing 0.47 instead of 0.54
    first_ratio: float = 0.4  # r_1: share of segments recomputed at layer 1 (layer 0: all)
    last_ratio: float = 0.1  # r_{L-1}; linear in between (r_i falls with depth)
    ratios: tuple[float, ...] = ()  # explicit r_0 .. r_{L-1} (r_0 must be 1); () = the line
    hops: int = 3  # re-scoring rounds until the set is stable (0: one hop only)

    def __post_init__(self):
        rs = (self.first_ratio, self.last_ratio, *self.ratios)
        if any(not 0.0 <= r <= 1.0 for r in rs) or self.hops < 0:
            raise ValueError(f"ratios must be in [0, 1] and hops >= 0: {self}")
        if self.ratios and self.ratios[0] != 1.0:
            raise ValueError(f"r_0 = {self.ratios[0]}: layer 0 recomputes everything (1.0)")

    def ratio(self, layer: int, num_layers: int) -> float:
        if self.ratios:
            if len(self.ratios) != num_layers:
                raise ValueError(f"{len(self.ratios)} ratios for {num_layers} layers")
            return self.ratios[layer]
        if layer == 0:
            return 1.0
        if num_layers <= 2:
            return self.first_ratio
        f = (layer - 1) / (num_layers - 2)
        return self.first_ratio + f * (self.last_ratio - self.first_ratio)


@dataclass(frozen=True)
class SegmentIndex:
    """A prompt's segments as tensors, built once per request."""

    count: int  # S segments
    last: torch.Tensor  # [S] int64 host: prompt token of each segment's last token
    of_token: torch.Tensor  # [n] int64 host: segment of each prompt token; S: header, query
    fixed: torch.Tensor  # [n] bool host: header and query (always computed)
    rows: torch.Tensor  # [Rm] int64 device: slot row of every segment token, prompt order
    bounds: torch.Tensor  # [S + 1] int64 device: segment j's tokens are rows[bounds[j]:bounds[j+1]]
    end: int  # slot row after the last segment token

    @staticmethod
    def build(lay: PromptLayout, row0: int, device: torch.device) -> SegmentIndex:
        token, owner, last = segment_tokens(lay)
        s = len(last)
        of_token = torch.full((lay.n,), s, dtype=torch.int64)
        of_token[token] = owner
        rows, bounds = to_device_as_one([row0 + token, segment_bounds(owner, s)], device)
        end = row0 + int(token.max()) + 1 if s else row0
        return SegmentIndex(s, last, of_token, fixed_mask(lay), rows, bounds, end)


def segment_tokens(lay: PromptLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (token [Rm]: every segment token's prompt index in prompt order, owner [Rm]: its
    segment, last [S]: each segment's last token), int64 on the host."""
    spans = torch.tensor(lay.segments(), dtype=torch.int64).view(-1, 2)  # [S, 2]
    start, n = spans.unbind(1)
    owner = torch.repeat_interleave(torch.arange(len(spans)), n)  # [Rm]
    token = start[owner] + torch.arange(len(owner)) - (n.cumsum(0) - n)[owner]
    return token, owner, start + n - 1


def segment_bounds(owner: torch.Tensor, count: int) -> torch.Tensor:
    """Columns owned by segments 0..count-1, in order (`owner` [R] int64 host,
    non-decreasing; values >= count: not a segment's, after them) -> [count + 1] int64
    host: segment j owns columns bounds[j]:bounds[j + 1]."""
    if len(owner) > 1 and bool((owner[1:] < owner[:-1]).any()):
        raise ValueError("segment columns must be in segment order")
    return torch.searchsorted(owner, torch.arange(count + 1))


def segment_sums(values: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Each row's sum over each segment's columns ([m, R], `bounds` [S + 1] from
    `segment_bounds` on values' device) -> [m, S] fp32. A running sum in fp64, then
    differences: a fixed order of additions on every device (no atomics), the exact sum
    to fp32 rounding, and no host value, so a graph runs it."""
    run = torch.nn.functional.pad(values.double().cumsum(1), (1, 0))  # [m, R + 1]
    return (run.index_select(1, bounds[1:]) - run.index_select(1, bounds[:-1])).float()


def fixed_mask(lay: PromptLayout) -> torch.Tensor:
    """[n] bool host: the header and the query (`lay.fixed()`)."""
    out = torch.ones(lay.n, dtype=torch.bool)
    out[lay.header : lay.query_start] = False
    return out


def token_mask(n: int, tokens: torch.Tensor) -> torch.Tensor:
    """Prompt token indices [m] -> [n] bool host."""
    out = torch.zeros(n, dtype=torch.bool)
    out[tokens] = True
    return out


@torch.no_grad()
def attention_mass(view: LayerView, src: torch.Tensor, segs: SegmentIndex) -> torch.Tensor:
    """Attention (softmax over every row a token reads, mean over heads) from the step
    rows `src` ([m] int64 host) to each segment -> [m, S] fp32 on the device."""
    lens_host = view.kv_len[src]
    src_d, lens = to_device_as_one([src, lens_host], view.q.device)
    reach = max(segs.end, int(lens_host.max()))  # rows past a token's own: masked
    keys = view.arena.k[view.layer, view.slot, :reach]
    probs = read_attention(view.q.index_select(0, src_d), keys, lens)
    return segment_sums(probs.index_select(1, segs.rows), segs.bounds)


def read_attention(q: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Each query row's attention over the slot rows `keys` ([R, Hkv, D]; row r >= its
    `lens` masked), softmax per head then the mean over heads -> [m, R] fp32. No host
    values: the graphed KEEP prefill (engine/keep_graph.py) runs it inside its graph."""
    q, k = q.float(), keys.float()
    m, hq, d = q.shape
    reach, hkv = k.shape[0], k.shape[1]
    scores = torch.einsum("mhgd,rhd->mhgr", q.view(m, hkv, hq // hkv, d), k) * d**-0.5
    mask = torch.arange(reach, device=q.device)[None, :] >= lens[:, None]  # [m, R]
    return scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1).mean((1, 2))


class KeepSelector:
    def __init__(self, cfg: KeepConfig, num_layers: int):
        self.cfg, self.num_layers = cfg, num_layers
        self.segs: tuple[PromptLayout, int, SegmentIndex] | None = None  # the last (row0)

    def initial(self, lay: PromptLayout) -> torch.Tensor:
        return torch.ones(lay.n, dtype=torch.bool)

    def next(self, view: LayerView, lay: PromptLayout) -> torch.Tensor:
        segs = self.index(view, lay)
        whole = torch.ones(segs.count + 1, dtype=torch.bool)  # the last: header and query
        whole[segs.of_token[~token_mask(lay.n, view.tokens)]] = False
        cand = whole[:-1].nonzero().view(-1)  # [C] segments computed at this layer
        r = self.cfg.ratio(view.layer + 1, self.num_layers)
        k = min(len(cand), math.ceil(r * segs.count - 1e-9))
        if k < len(cand):
            cand = cand[self._multi_hop(view, lay, segs, cand, k)] if k else cand[:0]
        chosen = torch.zeros(segs.count + 1, dtype=torch.bool)
        chosen[cand] = True
        return segs.fixed | chosen[segs.of_token]

    def index(self, view: LayerView, lay: PromptLayout) -> SegmentIndex:
        """The prompt's segments at this layer's rows: built once per request, again for
        a layer at another row0 (a compressed prefix)."""
        if self.segs is None or self.segs[0] is not lay or self.segs[1] != view.row0:
            self.segs = lay, view.row0, SegmentIndex.build(lay, view.row0, view.q.device)
        return self.segs[2]

    def _multi_hop(self, view: LayerView, lay: PromptLayout, segs: SegmentIndex,
                   cand: torch.Tensor, k: int) -> torch.Tensor:  # fmt: skip
        """-> the k chosen, as ascending indices into cand ([k] int64 host).

        Query attention, then hops: what the set attends to adds to the score. A segment
        attends through its last token (it has read the whole segment); the query rows
        and every candidate's last token are scored in one pass per layer. The hops run
        on the device without a stability test (a stable set stays stable), so the layer
        syncs once, for the answer. Scores and their means are fp64: the graphed prefill
        takes the same means as masked sums over padded sets, and in fp64 the order of
        the additions does not decide a ranking."""
        query = torch.searchsorted(view.tokens, torch.arange(lay.query_start, lay.n))
        last = torch.searchsorted(view.tokens, segs.last[cand]) if self.cfg.hops else query[:0]
        mass = attention_mass(view, torch.cat([query, last]), segs)  # [len(query) + C, S]
        mass = mass.index_select(1, to_device(cand, mass.device))  # [len(query) + C, C]
        q_mass, rows = mass[: len(query)].double().mean(0), mass[len(query) :].double()
        chosen = top_segments(q_mass, k)
        for _ in range(self.cfg.hops):
            chosen = top_segments(q_mass + rows.index_select(0, chosen).mean(0), k)
        return chosen.cpu()


def ranked(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k best, best first ([k] int64, score's device); stable on ties: the earlier
    segment first."""
    return torch.sort(-score, stable=True).indices[:k]


def top_segments(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k best, as ascending indices ([k] int64, score's device)."""
    return ranked(score, k).sort().values


class CacheBlendSelector:
    """Token level (CacheBlend): layer 0 computes every token; its output gives every
    memory token's V of layer 1 (one projection: layer 0's V depends on the token alone,
    so it cannot deviate), and the `ratio` of memory tokens whose V deviates most from
    the cached V (~15 %) are computed from layer 1 on with header and query."""

    def __init__(self, ratio: float = 0.15):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio={ratio} must be in [0, 1]")
        self.ratio = ratio

    def initial(self, lay: PromptLayout) -> torch.Tensor:
        return torch.ones(lay.n, dtype=torch.bool)

    @torch.no_grad()
    def next(self, view: LayerView, lay: PromptLayout) -> torch.Tensor:
        keep = token_mask(lay.n, view.tokens)
        img = view.image
        if view.layer > 0 or img is None:
            return keep
        toks = img.slot_row - view.row0  # [R] prompt tokens with a cached row (layer 0's rows)
        where = to_device(torch.searchsorted(view.tokens, toks), view.hidden.device)
        layer = view.backbone.layers[1]
        _, _, v = layer.self_attn.qkv(layer.input_layernorm(view.hidden.index_select(0, where)))
        old = to_device(img.v[1], v.device)  # [R, Hkv, D]
        d = (v.float() - old.float()).flatten(1).norm(dim=-1)
        k = math.ceil(self.ratio * len(toks) - 1e-9)
        keep[toks] = False
        if k:
            keep[toks[torch.topk(d, k).indices.cpu()]] = True
        return keep


class FixedSelector:
    """The same tokens at every layer: header + query (full reuse), or all of them."""

    def __init__(self, everything: bool = False):
        self.everything = everything

    def initial(self, lay: PromptLayout) -> torch.Tensor:
        return torch.ones(lay.n, dtype=torch.bool) if self.everything else fixed_mask(lay)

    def next(self, view: LayerView, lay: PromptLayout) -> torch.Tensor:
        return token_mask(lay.n, view.tokens)
