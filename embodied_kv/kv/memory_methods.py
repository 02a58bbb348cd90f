"""How a plan request gets its memory's KV: KEEP and its baselines, one interface.

Every method appends a PromptLayout (header + memory units + query) to a slot that
holds the frame's prefix and returns the logits after its last token; the slot then
continues decoding as any request. `grouped` says which memory's blocks it reads:
static groups as joint blocks (KEEP) or one block per segment (chunk caches).

    full         every prompt token prefilled (today's planner; the reference)
    prefix       the rows of the previous request's prompt up to the first changed
                 token are copied from a cache slot (exact); the rest is prefilled
    reuse        cached blocks concatenated, only header + query computed
    cacheblend   token-level: the ~15 % tokens with the largest V deviation at layer 1
    keep         static/dynamic blocks + multi-hop recomputation + layer-balanced loading
    keep-*       KEEP with one idea ablated
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embodied_kv.kv.host_image import ImageCache
from embodied_kv.kv.memory_kv import PromptLayout
from embodied_kv.kv.recompute import PrefillStats, selective_prefill
from embodied_kv.kv.selectors import CacheBlendSelector, FixedSelector, KeepConfig, KeepSelector
from embodied_kv.model.vla import VLA
from embodied_kv.storage.arena import KVArena


class FullRecompute:
    name, grouped, cached = "full", False, False

    def prefill(self, model: VLA, arena: KVArena, slot: int, lay: PromptLayout,
                frame: int = 0) -> torch.Tensor:  # fmt: skip
        return model.append(arena, slot, torch.tensor(lay.ids))


class PrefixCaching:
    """Exact reuse of the longest unchanged prefix of the previous prompt of the same
    frame, kept in its own arena slot (`cache_slot`, held by the caller)."""

    name, grouped, cached = "prefix", False, False

    def __init__(self, cache_slot: int):
        self.cache_slot = cache_slot
        self.frame: int | None = None
        self.ids: tuple[int, ...] = ()
        self.reused = 0  # tokens reused by the last request

    def prefill(self, model: VLA, arena: KVArena, slot: int, lay: PromptLayout,
                frame: int = 0) -> torch.Tensor:  # fmt: skip
        p = arena.length[:, slot].tolist()  # per layer (VL-Cache may have compressed them)
        common = 0
        if self.frame == frame:
            for a, b in zip(self.ids, lay.ids, strict=False):
                if a != b:
                    break
                common += 1
        common = min(common, lay.n - 1)  # the last token is fed: its logits are the answer
        if common:
            # one copy over every layer when they hold the same rows (as before VL-Cache)
            at = [(slice(None), p[0])] if len(set(p)) == 1 else list(enumerate(p))
            for layers, start in at:
                rows = slice(start, start + common)
                arena.k[layers, slot, rows].copy_(arena.k[layers, self.cache_slot, rows])
                arena.v[layers, slot, rows].copy_(arena.v[layers, self.cache_slot, rows])
            arena.length[:, slot] += common
            arena.next_pos[slot] += common
        logits = self.append(model, arena, slot, torch.tensor(lay.ids[common:]))
        self.reused = common
        return logits

    def append(self, model: VLA, arena: KVArena, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """The rest of the prompt after the rows reused -> logits after its last token."""
        return model.append(arena, slot, ids)

    def remember(self, arena: KVArena, slot: int, lay: PromptLayout, frame: int) -> None:
        """Keep this request's prompt rows (after the prefill, outside its TTFT)."""
        n = arena.slot_len(slot)
        arena.k[:, self.cache_slot, :n].copy_(arena.k[:, slot, :n])
        arena.v[:, self.cache_slot, :n].copy_(arena.v[:, slot, :n])
        self.frame, self.ids = frame, lay.ids


@dataclass
class Selective:
    """A method of the selective prefill: a selector, blocks, loading."""

    name: str
    grouped: bool
    make_selector: object  # (num_layers) -> Selector
    overlap: bool = True
    cached: bool = True
    stats: PrefillStats | None = None
    images: ImageCache = field(default_factory=ImageCache)  # its last request's host image

    def prefill(self, model: VLA, arena: KVArena, slot: int, lay: PromptLayout,
                frame: int = 0) -> torch.Tensor:  # fmt: skip
        selector = self.make_selector(len(model.backbone.layers))
        logits, self.stats = selective_prefill(model, arena, slot, lay, selector, self.overlap,
                                               self.images)  # fmt: skip
        return logits


def keep(cfg: KeepConfig | None = None, name: str = "keep", grouped: bool = True,
         overlap: bool = True) -> Selective:  # fmt: skip
    cfg = cfg or KeepConfig()
    return Selective(name, grouped, lambda n: KeepSelector(cfg, n), overlap)


def methods(cache_slot: int, keep_cfg: KeepConfig | None = None, blend: float = 0.15) -> list:
    """Every method of `bench keep`, the reference (full recomputation) first."""
    cfg = keep_cfg or KeepConfig()
    one_hop = KeepConfig(cfg.first_ratio, cfg.last_ratio, cfg.ratios, hops=0)
    return [
        FullRecompute(),
        PrefixCaching(cache_slot),
        Selective("reuse", False, lambda n: FixedSelector()),
        Selective("cacheblend", False, lambda n: CacheBlendSelector(blend)),
        keep(cfg),
        keep(cfg, "keep-no-static", grouped=False),
        keep(one_hop, "keep-one-hop"),
        keep(cfg, "keep-no-balance", overlap=False),
    ]
