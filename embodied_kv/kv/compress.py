"""VL-Cache: sparsity- and modality-aware compression of a visual prefix, in place in its slot.

After the prefill of a frame, for every layer:

    1. statistics  the attention of chosen query rows (VL-Cache: the post-vision prompt text)
                   over the prefix, per head: column sums and the count of entries below
                   p * rowmax (kernels/attn_stats.py); the prefill keeps the query rows (the
                   only time they exist), the statistics are computed when a language
                   request needs the selection, after the action expert
    2. budgets     per layer from its sparsity γ_l (Algorithm 1):
                   b_l = clip((1 - γ_l) / Σ(1 - γ) * α * L, 0.01, 1), then the clipped excess
                   or shortfall refilled over the unclipped layers so every method spends
                   exactly α * L * n_image image rows (equal KV bytes across methods)
    3. selection   per layer l and KV head h, the k_l image rows best scored by the query
                   heads that read h (head-wise, as SnapKV / PyramidKV / H2O evict), plus
                   every prompt text row; every head of a layer keeps k_l + τ rows
    4. compaction  each head's kept rows moved to the front of the slot, layer by layer
                   (ascending row order); length[l] = k_l + text rows; next_pos stays P, so
                   decode positions continue where the full prefix ended. K was stored after
                   RoPE: a kept key keeps its position, nothing is rotated again.

    slot (one layer, one head) before:  [ img img img img ... img | text text ]   length P
                               after:   [ img img text text | stale ...       ]   length k_l + τ

Heads of a layer keep different image rows but the same number, so one length per layer
still says which rows every head reads, and a decode appends its token at row length[l] in
all heads, as over a full slot.

The packed step reads rows [0, length[l]) per layer (storage/step.py), so a decode over a
compressed slot costs what its kept rows cost. The budget α counts image rows: the text rows
(what the model was asked) are always kept, by every method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels.attn_stats import (
    attn_stats_into,
    attn_stats_ref_layers,
    kv_head_sums,
    stats_workspace,
)
from embodied_kv.kv.presses import ALL_ROWS, POST_VISION, WINDOW, Press, budget_weights, get_press
from embodied_kv.storage.arena import KVArena

MIN_BUDGET = 0.01  # VL-Cache Algorithm 1: a layer keeps at least 1% of its rows


@dataclass(frozen=True)
class CompressConfig:
    budget: float = 1.0  # α: image rows kept, over all layers (language.kv_budget); 1 = off
    method: str = "vlcache"  # a press of kv/presses.py (language.kv_method)
    threshold: float = 0.01  # p: an entry below p * its row's max counts as sparse (VL-Cache)
    window: int = 8  # SnapKV / PyramidKV observation window: the prefix's last rows
    sink: int = 4  # StreamingLLM attention-sink rows
    compress_expert: bool = False  # the action expert reads the compressed prefix too

    def __post_init__(self):
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"kv budget {self.budget} must be in (0, 1] (1.0 = off)")
        get_press(self.method)
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"sparsity threshold {self.threshold} must be in (0, 1)")
        if self.window < 1 or self.sink < 0:
            raise ValueError(f"window={self.window} must be >= 1 and sink={self.sink} >= 0")

    @property
    def enabled(self) -> bool:
        return self.budget < 1.0 and self.method != "full"

    @property
    def press(self) -> Press:
        return get_press(self.method)


@dataclass(frozen=True)
class PrefixLayout:
    n_rows: int  # P: rows of the prefix in the slot
    n_image: int  # rows [0, n_image) are image tokens; [n_image, P) the prompt text

    def __post_init__(self):
        if not 0 <= self.n_image < self.n_rows:
            raise ValueError(f"a {self.n_rows}-row prefix cannot hold {self.n_image} image rows")

    def query_rows(self, which: str, window: int) -> tuple[int, int]:
        """The query rows [a, b) whose attention scores a press reads."""
        if which == ALL_ROWS:
            return 0, self.n_rows
        if which == WINDOW:  # the observation window never reaches into the image
            return max(self.n_image, self.n_rows - window), self.n_rows
        assert which == POST_VISION, which
        return self.n_image, self.n_rows


@dataclass
class PrefixStats:
    scores: dict[str, torch.Tensor]  # query range -> [L, Hkv, P] fp32 column sums over
    # the query heads of each KV head (the heads that read that head's keys)
    sparsity: torch.Tensor | None  # [L] fp64: post-vision sparsity averaged over heads


class StatsRecorder:
    """The observer of one prefill (GemmaBackbone.forward). During the prefill it keeps only
    each layer's query rows of the ranges in `ranges` (one copy per layer and range: the
    queries exist only then) and the layer's key cache; `stats` computes every layer's
    statistics over the slot's P prefix rows afterwards, when the rows to keep are chosen
    (KVCacheManager.selection, after the action expert, and only for a frame that has a
    language request): on CUDA one kernel launch per layer and range, elsewhere one batched
    reference over all layers. The action's critical path pays the copies alone."""

    def __init__(self, layout: PrefixLayout, slot: int, ranges: dict[str, tuple[int, int]],
                 layers: int, scale: float, threshold: float, heads: int, device,
                 kernel: bool | None = None):  # fmt: skip
        self.layout, self.slot, self.ranges = layout, slot, ranges
        self.scale, self.threshold = scale, threshold
        self.layers, self.heads, self.device = layers, heads, torch.device(device)
        # the Triton kernel per layer (None: on CUDA; True on CPU needs TRITON_INTERPRET=1)
        self.kernel = self.device.type == "cuda" if kernel is None else kernel
        self.queries: dict[str, torch.Tensor] = {}  # range -> [L, rows, Hq, D], at layer 0
        self.keys: list[torch.Tensor | None] = [None] * layers  # each layer's k_cache

    def __call__(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        for name, (a, b) in self.ranges.items():
            if name not in self.queries:
                self.queries[name] = q.new_empty(self.layers, b - a, *q.shape[1:])
            self.queries[name][layer].copy_(q[a:b])
        self.keys[layer] = k_cache  # [S, T, Hkv, D]: rows [0, P) of the slot are this layer's

    def stats(self) -> PrefixStats:
        """Per range, layer and KV head, the column sums over the prefix rows (summed over
        the head's query heads), and the post-vision sparsity; the slot must still hold the
        prefix the prefill wrote."""
        if any(k is None for k in self.keys):
            raise RuntimeError("the prefill did not run every layer through the recorder")
        n = self.layout.n_rows
        keys = torch.stack([k[self.slot, :n] for k in self.keys])  # [L, P, Hkv, D]
        kv_heads = keys.shape[2]
        scores, sparsity = {}, None
        for name, q in self.queries.items():
            colsum, below = self._layers(q, keys)  # [L, Hq, P], [L, Hq]
            scores[name] = kv_head_sums(colsum, kv_heads)
            if name == POST_VISION:
                a, b = self.ranges[name]
                sparsity = (below.double() / ((b - a) * n)).mean(1).cpu()
        return PrefixStats(scores, sparsity)

    def _layers(self, q: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kernel:
            return attn_stats_ref_layers(q, keys, self.scale, self.threshold)
        colsum, below = stats_workspace(q.shape[1], self.heads, keys.shape[1], self.device,
                                        self.layers, kernel=True)  # fmt: skip
        for layer in range(self.layers):
            attn_stats_into(q[layer], keys[layer], self.scale, self.threshold, colsum[layer],
                            below[layer])  # fmt: skip
        return colsum.sum(1), below.sum(1, dtype=torch.int64)


@dataclass(frozen=True)
class Selection:
    """The rows a compressed slot keeps: per layer and KV head, ascending row indices (image
    rows picked by the press, then every text row); the heads of a layer keep as many."""

    layout: PrefixLayout
    keep: tuple[torch.Tensor, ...]  # L x [Hkv, k_l + τ] int64 (host)

    @property
    def lengths(self) -> list[int]:
        return [int(k.shape[-1]) for k in self.keep]


def image_rows_total(budget: float, layers: int, n_image: int) -> int:
    """Image rows all layers keep together at budget α: α * L * n_image, at least one per
    layer."""
    return min(layers * n_image, max(layers, round(budget * layers * n_image)))


def fill_budgets(weights: torch.Tensor, budget: float, lo: float = MIN_BUDGET) -> torch.Tensor:
    """Per-layer fractions [L] ∝ weights, clipped to [lo, 1], summing to budget * L: the
    clip of Algorithm 1, then what the clip took or gave spread over the unclipped layers
    (in proportion to their weights) until the total holds."""
    layers = weights.shape[0]
    w = weights.double().clamp(min=0)
    w = w if w.sum() > 0 else torch.ones_like(w)
    total = budget * layers
    b = (w / w.sum() * total).clamp(lo, 1.0)
    for _ in range(layers):
        gap = total - float(b.sum())
        free = b > lo if gap < 0 else b < 1.0  # layers that can give / take
        if abs(gap) < 1e-12 or not free.any():
            break
        wf = w[free] if w[free].sum() > 0 else torch.ones_like(w[free])
        b[free] += gap * wf / wf.sum()
        b = b.clamp(lo, 1.0)
    return b


def round_rows(fractions: torch.Tensor, n_image: int, total: int) -> list[int]:
    """Rows per layer from fractions of n_image: largest remainders, summing to `total`,
    each in [1, n_image] (one row per layer and pass, largest remainder first)."""
    want = fractions.double() * n_image
    rows = want.floor().clamp(1, n_image).long().tolist()
    order = torch.sort(want - want.floor(), descending=True, stable=True).indices.tolist()
    gap = total - sum(rows)
    while gap:
        moved = False
        for i in order if gap > 0 else order[::-1]:
            if gap > 0 and rows[i] < n_image:
                rows[i], gap, moved = rows[i] + 1, gap - 1, True
            elif gap < 0 and rows[i] > 1:
                rows[i], gap, moved = rows[i] - 1, gap + 1, True
            if not gap:
                break
        if not moved:
            raise AssertionError(f"cannot spread {total} rows over {fractions.tolist()}")
    return rows


def allocate(press: Press, cfg: CompressConfig, stats: PrefixStats | None,
             layers: int, n_image: int) -> list[int]:  # fmt: skip
    """Image rows each layer keeps under `press` at cfg.budget: the same total for every
    method except `full` (all rows)."""
    if press.budgets == "full":
        return [n_image] * layers
    weights = budget_weights(press, stats.sparsity if stats else None, layers)
    total = image_rows_total(cfg.budget, layers, n_image)
    return round_rows(fill_budgets(weights, total / (layers * n_image)), n_image, total)


def select(press: Press, cfg: CompressConfig, layout: PrefixLayout,
           stats: PrefixStats | None, layers: int, kv_heads: int) -> Selection:  # fmt: skip
    """The rows each layer and KV head keeps: the press's best k_l image rows by that head's
    scores (positional presses: the same rows in every head), then the text rows."""
    counts = allocate(press, cfg, stats, layers, layout.n_image)
    text = torch.arange(layout.n_image, layout.n_rows)
    keep = []
    for layer, k in enumerate(counts):
        heads = stats.scores[press.scores][layer] if press.scores else [None] * kv_heads
        if len(heads) != kv_heads:
            raise ValueError(f"scores of {len(heads)} KV heads for a model with {kv_heads}")
        rows = [press.rank(scores, layout.n_image, cfg.sink)[:k] for scores in heads]
        keep.append(torch.stack([torch.cat([torch.sort(r).values, text]) for r in rows]))
    return Selection(layout, tuple(keep))


def compact(arena: KVArena, slot: int, selection: Selection) -> None:
    """Move each layer's kept rows to the front of `slot` and set its per-layer lengths.
    The slot must hold exactly the prefix (right after its prefill); ValueError otherwise,
    with nothing changed."""
    layout, spec = selection.layout, arena.spec
    lens = arena.length[:, slot]
    if len(selection.keep) != spec.num_layers:
        raise ValueError(f"selection of {len(selection.keep)} layers for {spec.num_layers}")
    if bool((lens != layout.n_rows).any()) or int(arena.next_pos[slot]) != layout.n_rows:
        raise ValueError(
            f"slot {slot} holds lengths {lens.tolist()} (next_pos {int(arena.next_pos[slot])}), "
            f"not exactly the {layout.n_rows}-row prefix the selection was made for"
        )
    for keep in selection.keep:
        if keep.dim() != 2 or keep.shape[0] != spec.kv_heads or keep.shape[1] == 0:
            raise ValueError(f"kept rows of shape {tuple(keep.shape)}: want [{spec.kv_heads} "
                             f"KV heads, rows > 0]")  # fmt: skip
        if int(keep.min()) < 0 or int(keep.max()) >= layout.n_rows:
            raise ValueError(f"kept rows {keep.tolist()} outside the prefix of {layout.n_rows}")
    for layer, keep in enumerate(selection.keep):
        n = keep.shape[1]
        idx = keep.t().to(arena.device)[:, :, None].expand(n, spec.kv_heads, spec.head_dim)
        # the gather copies first, so moving rows forward never reads a row already written
        arena.k[layer, slot, :n] = arena.k[layer, slot].gather(0, idx)
        arena.v[layer, slot, :n] = arena.v[layer, slot].gather(0, idx)
        arena.length[layer, slot] = n


class Compressor:
    """What the KV manager holds: records a frame's statistics during its prefill, selects
    once per frame, compacts the slot a language request decodes in."""

    def __init__(self, cfg: CompressConfig, model):
        b = model.cfg.backbone
        self.cfg, self.press, self.layers, self.heads = cfg, cfg.press, b.layers, b.heads
        self.kv_heads = b.kv_heads
        self.scale, self.device = model.backbone.scale, model.device

    def ranges(self, layout: PrefixLayout) -> dict[str, tuple[int, int]]:
        """Query rows the press reads, plus the post-vision rows when it needs sparsity."""
        names = {self.press.scores} - {None}
        if self.press.budgets == "sparsity":
            names.add(POST_VISION)
        return {n: layout.query_rows(n, self.cfg.window) for n in sorted(names)}

    def recorder(self, slot: int, layout: PrefixLayout) -> StatsRecorder | None:
        """The prefill's observer, or None when this frame is not compressed."""
        ranges = self.ranges(layout)
        if not self.cfg.enabled or layout.n_image == 0 or not ranges:
            return None
        return StatsRecorder(layout, slot, ranges, self.layers, self.scale,
                             self.cfg.threshold, self.heads, self.device)  # fmt: skip

    def select(self, layout: PrefixLayout, recorder: StatsRecorder | None) -> Selection | None:
        if not self.cfg.enabled or layout.n_image == 0:
            return None
        stats = recorder.stats() if recorder is not None else None
        return select(self.press, self.cfg, layout, stats, self.layers, self.kv_heads)
