"""KV-compression methods for a visual prefix: one small class each behind one interface
(kvpress's shape), so the benchmark loops over objects and an ablation is another object.

A press turns a prefix's statistics into the image rows each layer keeps:

    prefix rows:  [ image rows 0 .. n_image-1 | prompt text n_image .. P-1 ]
                    ^ a press picks k_l of these per layer   ^ always kept (post-vision text)

Every press spends the same total, `image_rows_total(α, L, n_image)` rows over the L layers
(budgets.py-style allocation in kv/compress.py), so methods compare at equal KV bytes.

    press             scores (which query rows' attention)   per-layer budget
    full              -                                      everything
    streaming         sink + most recent rows (StreamingLLM)  uniform
    h2o               all prefix rows (accumulated)           uniform
    snapkv            the last `window` prompt rows, pooled   uniform
    pyramidkv         as snapkv                               linearly decreasing (PyramidKV)
    vlcache           post-vision rows                        from sparsity (VL-Cache Alg. 1)
    vlcache_uniform   post-vision rows                        uniform       (ablation)
    vlcache_accum     all prefix rows (accumulated)           from sparsity (ablation)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Query-row ranges a press may need statistics for (kv/compress.py StatsRecorder).
POST_VISION = "post_vision"  # rows [n_image, P): the prompt text after the images
ALL_ROWS = "all"  # rows [0, P): accumulated attention over the whole prefix
WINDOW = "window"  # the last `window` rows of the prefix (SnapKV's observation window)

PYRAMID_BETA = 20  # PyramidKV: the top layer keeps 1/beta of the mean budget
SNAPKV_POOL = 5  # SnapKV: scores average-pooled over this many neighbouring rows


@dataclass(frozen=True)
class Press:
    """Scores image rows and allocates per-layer budgets. `scores` None: positional."""

    name: str
    scores: str | None  # POST_VISION | ALL_ROWS | WINDOW | None
    budgets: str  # "uniform" | "sparsity" | "pyramid" | "full"
    pool: int = 1  # average-pool width over neighbouring rows (SnapKV)

    def rank(self, layer_scores: torch.Tensor, n_image: int, sink: int) -> torch.Tensor:
        """Image rows of one layer, best first: layer_scores [P] (None-scoring presses
        ignore it) -> [n_image] int64 row indices."""
        if self.scores is None:  # StreamingLLM: the sink, then the most recent rows
            sink = min(sink, n_image)
            recent = torch.arange(n_image - 1, sink - 1, -1)
            return torch.cat([torch.arange(sink), recent])
        s = layer_scores[:n_image].float().cpu()
        if self.pool > 1:
            s = F.avg_pool1d(s.view(1, 1, -1), self.pool, 1, self.pool // 2,
                             count_include_pad=False).view(-1)  # fmt: skip
        # stable: equal scores keep row order, so a selection never depends on the sort
        return torch.sort(s, descending=True, stable=True).indices


PRESSES: dict[str, Press] = {
    p.name: p
    for p in (
        Press("full", None, "full"),
        Press("streaming", None, "uniform"),
        Press("h2o", ALL_ROWS, "uniform"),
        Press("snapkv", WINDOW, "uniform", pool=SNAPKV_POOL),
        Press("pyramidkv", WINDOW, "pyramid", pool=SNAPKV_POOL),
        Press("vlcache", POST_VISION, "sparsity"),
        Press("vlcache_uniform", POST_VISION, "uniform"),
        Press("vlcache_accum", ALL_ROWS, "sparsity"),
    )
}


def get_press(name: str) -> Press:
    if name not in PRESSES:
        raise ValueError(f"unknown KV compression method {name!r}; known: {sorted(PRESSES)}")
    return PRESSES[name]


def budget_weights(press: Press, sparsity: torch.Tensor | None, layers: int) -> torch.Tensor:
    """Relative per-layer budgets [L] (any positive scale) before clipping and filling.

    sparsity: VL-Cache Algorithm 1, budget_l ∝ 1 - γ_l (γ_l the layer's post-vision
    sparsity); pyramid: PyramidKV's arithmetic sequence from 2 - 1/β (layer 0) down to
    1/β (the top layer) of the mean; uniform: equal."""
    if press.budgets == "sparsity":
        if sparsity is None or sparsity.shape != (layers,):
            raise ValueError(f"{press.name} needs the sparsity of {layers} layers, got {sparsity}")
        w = (1.0 - sparsity.double().cpu()).clamp(min=0.0)
        return w if w.sum() > 0 else torch.ones(layers, dtype=torch.float64)
    if press.budgets == "pyramid" and layers > 1:
        top = 1.0 / PYRAMID_BETA
        return torch.linspace(2.0 - top, top, layers, dtype=torch.float64)
    return torch.ones(layers, dtype=torch.float64)
