"""The planner's memory in the engine: how a plan request reads it.

The memory itself (kv/memory.py SegmentMemory) is part of the session: a capsule
carries its segments, groups and host-tier blocks, `reset` empties it. A plan
request's text is the memory's prompt (`\\nFacts: s1 s2 ...\\nQuery: goal\\nAnswer: `,
the world model's trained format). At admission:

* `full`: the text is appended and prefilled whole (full recomputation);
* `keep`: a memory of fewer than `min_segments` segments is prefilled whole, as in
  `full` (exact; on a few facts KEEP's approximation costs answers and saves no time
  worth having: docs/keep.md); else, if the text is still the memory's prompt for its
  goal, the missing blocks
  are computed (a free slot as the work slot), then the selective prefill places the
  blocks and recomputes what KEEP selects (over a prefix VL-Cache compressed too: each
  layer's cached rows go to that layer's own offset); otherwise (the memory changed
  since the request, or no work slot is free) the text is prefilled whole, as in `full`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embodied_kv.engine.graphs import GraphRunner
from embodied_kv.engine.keep_graph import GraphKeep
from embodied_kv.kv.memory import HEADER, SegmentMemory, piece, query_suffix
from embodied_kv.kv.memory_kv import compute_block, encode, layout
from embodied_kv.kv.memory_methods import keep
from embodied_kv.kv.selectors import KeepConfig
from embodied_kv.model.vla import VLA

MODES = ("keep", "full")


def embedder(model: VLA) -> Callable[[str], torch.Tensor]:
    """Text -> the mean of its token embeddings in the backbone's own table [W]."""

    @torch.no_grad()
    def embed(text: str) -> torch.Tensor:
        ids = torch.tensor(encode(model, text) or [model.tokenizer.eos_id], device=model.device)
        return model.backbone.embed_tokens(ids).float().mean(0)

    return embed


class MemoryPlanner:
    def __init__(self, model: VLA, memory: SegmentMemory, mode: str = "keep",
                 keep_cfg: KeepConfig | None = None, min_segments: int = 0):  # fmt: skip
        if mode not in MODES:
            raise ValueError(f"memory mode {mode!r}: use one of {MODES}")
        if min_segments < 0:
            raise ValueError(f"min_segments={min_segments} must be >= 0")
        self.model, self.memory, self.mode = model, memory, mode
        self.keep_cfg = keep_cfg or KeepConfig()
        self.min_segments = min_segments
        self.method = keep(self.keep_cfg)
        self.fallbacks = 0  # KEEP plans prefilled whole (memory changed, no work slot)
        self.small = 0  # plans prefilled whole: the memory under min_segments
        self.runner: GraphRunner | None = None  # blocks computed from its step graphs

    def use_graphs(self, runner: GraphRunner) -> None:
        """KEEP's prefill replayed from graphs (engine/keep_graph.py): the first plan that
        no graph kept holds captures one, with room to grow, inside that plan's admission."""
        self.method = GraphKeep(runner, self.keep_cfg, "keep")
        self.runner = runner

    def prefill_for(self, arena, text: str) -> Callable[[int], torch.Tensor] | None:
        """For a plan request's text: a function slot -> logits that prefills it with
        KEEP, or None (prefill the text whole)."""
        if self.mode != "keep":
            return None
        if len(self.memory) < self.min_segments:  # segments
            self.small += 1
            return None
        goal = self._goal(text)
        if goal is None:
            self.fallbacks += 1
            return None

        def whole(slot: int) -> torch.Tensor:
            self.fallbacks += 1
            return self.model.append(arena, slot, torch.tensor(encode(self.model, text)))

        def prefill(slot: int) -> torch.Tensor:
            units = self.memory.units()
            if any(u.key not in self.memory.blocks for u in units):
                work = arena.allocate()
                if work is None:
                    return whole(slot)
                try:
                    runner = self.runner if self.runner and self.runner.arena is arena else None
                    compute = lambda texts: compute_block(self.model, arena, work, texts, runner)  # noqa: E731
                    self.memory.refresh(compute, units)
                finally:
                    arena.release(work)
            lay = layout(self.model, units, self.memory.blocks, goal)
            return self.method.prefill(self.model, arena, slot, lay)

        return prefill

    def _goal(self, text: str) -> str | None:
        """The goal if `text` is the memory's prompt for it now, else None."""
        body = HEADER + "".join(piece(t) for u in self.memory.units() for t in u.texts)
        start, end = body + query_suffix(""), query_suffix("x").split("x")[1]
        head = start[: -len(end)]
        if not (text.startswith(head) and text.endswith(end)):
            return None
        goal = text[len(head) : len(text) - len(end)]
        return goal if self.memory.prompt(goal) == text else None
