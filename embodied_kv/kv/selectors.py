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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.kv.recompute import LayerView


@dataclass(frozen=True)
class KeepConfig:
    first_ratio: float = 0.5  # r_1: share of segments recomputed at layer 1 (layer 0: all)
    last_ratio: float = 0.2  # r_{L-1}; linear in between (r_i falls with depth)
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


@torch.no_grad()
def attention_mass(view: LayerView, src: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Attention (softmax over every row a token reads, mean over heads) from the step
    rows `src` to each span of prompt tokens -> [len(src), len(spans)] fp32."""
    arena, i = view.arena, view.layer
    q = view.q[src].float()  # [m, Hq, D]
    span_end = view.row0 + max(a + n for a, n in spans)
    reach = max(span_end, *(view.kv_len[j] for j in src))  # rows past a token's own: masked
    k = arena.k[i, view.slot, :reach].float()  # [R, Hkv, D]
    m, hq, d = q.shape
    hkv = k.shape[1]
    scores = torch.einsum("mhgd,rhd->mhgr", q.view(m, hkv, hq // hkv, d), k) * d**-0.5
    lens = torch.tensor([view.kv_len[j] for j in src], device=q.device)
    mask = torch.arange(reach, device=q.device)[None, :] >= lens[:, None]  # [m, R]
    probs = scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1).mean((1, 2))
    rows = [view.row0 + a + j for a, n in spans for j in range(n)]
    owner = [s for s, (_, n) in enumerate(spans) for _ in range(n)]
    out = torch.zeros(m, len(spans), device=q.device)
    idx = torch.tensor(rows, device=q.device)
    return out.index_add_(1, torch.tensor(owner, device=q.device), probs.index_select(1, idx))


class KeepSelector:
    def __init__(self, cfg: KeepConfig, num_layers: int):
        self.cfg, self.num_layers = cfg, num_layers

    def initial(self, lay: PromptLayout) -> set[int]:
        return set(range(lay.n))

    def next(self, view: LayerView, lay: PromptLayout) -> set[int]:
        spans = lay.segments()
        have = set(view.tokens)
        cand = [s for s, (a, n) in enumerate(spans) if all(t in have for t in range(a, a + n))]
        r = self.cfg.ratio(view.layer + 1, self.num_layers)
        k = min(len(cand), math.ceil(r * len(spans) - 1e-9))
        if k == len(cand):
            chosen = set(cand)
        else:
            chosen = self._multi_hop(view, lay, spans, cand, k) if k else set()
        keep = set(lay.fixed())
        for s in chosen:
            keep |= set(range(spans[s][0], spans[s][0] + spans[s][1]))
        return keep

    def _multi_hop(self, view, lay, spans, cand: list[int], k: int) -> set[int]:
        """Query attention, then hops: what the set attends to adds to the score. A
        segment attends through its last token (it has read the whole segment); the
        query rows and every candidate's last token are scored in one pass per layer."""
        row = {t: j for j, t in enumerate(view.tokens)}
        cs = [spans[s] for s in cand]
        query = [row[t] for t in range(lay.query_start, lay.n)]
        last = [row[a + n - 1] for a, n in cs] if self.cfg.hops else []
        mass = attention_mass(view, query + last, cs).cpu()  # [len(query) + C, C]
        q_mass, rows = mass[: len(query)].mean(0), mass[len(query) :]
        chosen = _top(q_mass, k)
        for _ in range(self.cfg.hops):
            new = _top(q_mass + rows[sorted(chosen)].mean(0), k)
            if new == chosen:
                break
            chosen = new
        return {cand[c] for c in chosen}


def _top(score: torch.Tensor, k: int) -> set[int]:
    # stable on ties: the earlier segment first
    return set(torch.sort(-score.float(), stable=True).indices[:k].tolist())


class CacheBlendSelector:
    """Token level (CacheBlend): layer 0 computes every token; its output gives every
    memory token's V of layer 1 (one projection: layer 0's V depends on the token alone,
    so it cannot deviate), and the `ratio` of memory tokens whose V deviates most from
    the cached V (~15 %) are computed from layer 1 on with header and query."""

    def __init__(self, ratio: float = 0.15):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio={ratio} must be in [0, 1]")
        self.ratio = ratio

    def initial(self, lay: PromptLayout) -> set[int]:
        return set(range(lay.n))

    @torch.no_grad()
    def next(self, view: LayerView, lay: PromptLayout) -> set[int]:
        if view.layer > 0:
            return set(view.tokens)
        row = {t: j for j, t in enumerate(view.tokens)}
        layer = view.backbone.layers[1]
        toks, cached = [], []
        for p in lay.placed:
            if p.block is not None:
                toks += range(p.start, p.start + p.n)
                cached.append(p.block.v[1])
        if not toks:
            return set(view.tokens)
        h = view.hidden[torch.tensor([row[t] for t in toks], device=view.hidden.device)]
        _, _, v = layer.self_attn.qkv(layer.input_layernorm(h))  # [m, Hkv, D]
        old = torch.cat(cached).to(v.device)
        d = (v.float() - old.float()).flatten(1).norm(dim=-1)
        k = math.ceil(self.ratio * len(toks) - 1e-9)
        top = {toks[j] for j in torch.topk(d, k).indices.tolist()} if k else set()
        memory = set(toks)
        return {t for t in view.tokens if t not in memory} | top


class FixedSelector:
    """The same tokens at every layer: header + query (full reuse), or all of them."""

    def __init__(self, everything: bool = False):
        self.everything = everything

    def initial(self, lay: PromptLayout) -> set[int]:
        return set(range(lay.n)) if self.everything else set(lay.fixed())

    def next(self, view: LayerView, lay: PromptLayout) -> set[int]:
        return set(view.tokens)
