"""VL-Cache compression (kv/compress.py, kv/presses.py): budgets of Algorithm 1, head-wise
selection, in-place compaction with per-layer lengths, and decode over a compressed slot, on
the tiny model (2 cameras x 16 image rows + the prompt's text rows) with the shipped world
model's attention (4 KV heads: every head keeps its own rows)."""

from dataclasses import replace

import pytest
import torch

from embodied_kv.kv.compress import (
    CompressConfig,
    PrefixLayout,
    Selection,
    StatsRecorder,
    allocate,
    compact,
    fill_budgets,
    image_rows_total,
    round_rows,
)
from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.kv.presses import POST_VISION, PRESSES, get_press
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

MAX_LEN = 192


KV_HEADS = 4


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny")
    cfg = replace(cfg, backbone=replace(cfg.backbone, kv_heads=KV_HEADS),
                  expert=replace(cfg.expert, kv_heads=KV_HEADS))  # fmt: skip
    return build_model(cfg)


def every_row(layout, layers=4):
    return Selection(layout, tuple(torch.arange(layout.n_rows).expand(KV_HEADS, -1)
                                   for _ in range(layers)))  # fmt: skip


def frame(model, cfg, seed=0):
    """A manager with `cfg`, its frame prefilled -> (manager, FramePrefix)."""
    m = KVCacheManager(model, 4, MAX_LEN, cfg)
    obs = synthetic_observation(model.cfg, seed, "put the red ball in the box")
    return m, m.prefill_frame(0, model.embed_prefix(obs))


def greedy(model, arena, slot, first: torch.Tensor, n: int) -> tuple[list[int], list[bytes]]:
    """Append `first` ids, then n greedy tokens -> (ids, the logits' bytes at every step)."""
    logits = model.append(arena, slot, first)
    ids, raw = [], [logits.numpy().tobytes()]
    for _ in range(n):
        tok = logits.argmax().view(1)
        ids.append(int(tok))
        logits = model.decode(arena, [slot], tok)[0]
        raw.append(logits.numpy().tobytes())
    return ids, raw


# -- budgets ------------------------------------------------------------------------------


def test_algorithm1_budgets_follow_density_and_keep_the_total():
    sparsity = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    b = fill_budgets(1 - sparsity, 0.1)
    # unclipped, Algorithm 1 is budget_l = (1 - γ_l) / Σ(1 - γ) * α * L
    expected = (1 - sparsity) / (1 - sparsity).sum() * 0.1 * 4
    torch.testing.assert_close(b, expected)
    # clipped at 1: the excess goes to the other layers, the total stays α * L
    b = fill_budgets(torch.tensor([100.0, 1.0, 1.0, 1.0]), 0.5)
    assert b[0] == 1.0 and abs(float(b.sum()) - 2.0) < 1e-9 and (b[1:] > 0.3).all()
    # clipped at 0.01 from below: a fully sparse layer still keeps 1%
    b = fill_budgets(torch.tensor([0.0, 1.0, 1.0, 1.0]), 0.05)
    assert b[0] == pytest.approx(0.01) and float(b.sum()) == pytest.approx(0.2)


def test_rows_sum_to_the_same_total_for_every_method():
    layers, n_image = 4, 128
    sparsity = torch.tensor([0.5, 0.7, 0.9, 0.95], dtype=torch.float64)
    from embodied_kv.kv.compress import PrefixStats

    stats = PrefixStats({}, sparsity)
    for budget in (0.01, 0.05, 0.1, 0.2, 0.4):
        total = image_rows_total(budget, layers, n_image)
        for name, press in PRESSES.items():
            rows = allocate(press, CompressConfig(budget=budget), stats, layers, n_image)
            assert all(1 <= r <= n_image for r in rows), (name, rows)
            assert sum(rows) == (layers * n_image if name == "full" else total), (name, rows)
    pyramid = allocate(get_press("pyramidkv"), CompressConfig(budget=0.2), None, 4, 128)
    assert pyramid == sorted(pyramid, reverse=True) and pyramid[0] > pyramid[-1]
    assert round_rows(torch.tensor([0.5, 0.5]), 3, 3) in ([2, 1], [1, 2])
    # remainders go one per layer, largest first, not all to one layer
    assert round_rows(torch.tensor([0.3, 0.3, 0.3, 0.3]), 10, 16) == [4, 4, 4, 4]
    assert round_rows(torch.tensor([0.34, 0.32, 0.3, 0.3]), 10, 14) == [4, 4, 3, 3]


def test_bad_configs_are_refused():
    for bad in ({"budget": 0.0}, {"budget": 1.5}, {"method": "nope"}, {"threshold": 1.0},
                {"window": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            CompressConfig(**bad)
    with pytest.raises(ValueError, match="image rows"):
        PrefixLayout(10, 10)


# -- selection and compaction -------------------------------------------------------------


@pytest.mark.parametrize("method", ["vlcache", "streaming", "snapkv", "vlcache_accum"])
def test_compaction_keeps_exactly_the_selected_rows(model, method):
    m, fp = frame(model, CompressConfig(budget=0.2, method=method))
    assert fp.selection is None and fp.pending is not None  # chosen after the expert
    sel, arena, s = m.selection(fp), m.arena, fp.slot
    layout = sel.layout
    assert layout.n_image == 32 and not fp.compressed
    before_k, before_v = arena.k[:, s].clone(), arena.v[:, s].clone()
    req = m.create(fp, "q", TaskKind.ANSWER, 4, [5, 6])
    assert req.slot == s and fp.compressed
    for layer, keep in enumerate(sel.keep):
        assert keep.shape[0] == KV_HEADS
        n = keep.shape[1]
        assert int(arena.length[layer, s]) == n
        text = torch.arange(layout.n_image, layout.n_rows)
        for h, rows in enumerate(keep):  # each KV head: its own rows, moved to the front
            assert torch.equal(rows[-text.shape[0] :], text)  # every prompt text row stays
            assert torch.equal(rows, torch.sort(rows).values)
            assert torch.equal(arena.k[layer, s, :n, h], before_k[layer, rows, h])
            assert torch.equal(arena.v[layer, s, :n, h], before_v[layer, rows, h])
    assert int(arena.next_pos[s]) == layout.n_rows  # positions continue after the full prefix
    total = image_rows_total(0.2, 4, 32)
    assert sum(n - (layout.n_rows - layout.n_image) for n in sel.lengths) == total


def test_vlcache_keeps_the_best_post_vision_scored_rows(model):
    """The kept image rows of each layer are its top-k by post-vision attention, recorded
    during the prefill (column sums of τ rows sum to τ per head)."""
    cfg = CompressConfig(budget=0.25)
    m = KVCacheManager(model, 4, MAX_LEN, cfg)
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 1, "stack the blocks"))
    layout = PrefixLayout(prefix.embeds.shape[0], prefix.n_image)
    slot = m.arena.allocate()
    rec = m.compressor.recorder(slot, layout)
    model.prefill(m.arena, slot, prefix, observer=rec)
    stats = rec.stats()
    tau = layout.n_rows - layout.n_image
    group = model.cfg.backbone.heads // KV_HEADS  # query heads per KV head
    want = torch.full((4, KV_HEADS), tau * group * 1.0)
    torch.testing.assert_close(stats.scores[POST_VISION].sum(-1), want)
    assert ((stats.sparsity >= 0) & (stats.sparsity <= 1)).all()
    sel = m.compressor.select(layout, rec)
    differ = 0
    for layer, keep in enumerate(sel.keep):
        for h, rows in enumerate(keep):
            img = rows[rows < layout.n_image]
            score = stats.scores[POST_VISION][layer, h, : layout.n_image]
            dropped = torch.ones(layout.n_image, dtype=torch.bool)
            dropped[img] = False
            assert score[img].min() >= score[dropped].max()
        differ += any(not torch.equal(keep[0], rows) for rows in keep[1:])
    assert differ > 0  # heads attend differently, so they keep different rows


@pytest.mark.parametrize("kernel", [False, True])
def test_deferred_statistics_equal_each_layers_attention(model, kernel):
    """The prefill only keeps each layer's query rows; `stats` afterwards (one batched
    reference, or the Triton kernel per layer as on CUDA, here under the interpreter)
    equals the attention statistics of those rows over that layer's prefix keys."""
    from embodied_kv.kernels.attn_stats import attn_stats_ref
    from embodied_kv.kernels.triton_base import INTERPRETED
    from embodied_kv.kv.presses import ALL_ROWS, WINDOW

    if kernel and not INTERPRETED:
        pytest.skip("no Triton interpreter")
    m = KVCacheManager(model, 4, MAX_LEN)
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 3, "open the drawer"))
    layout = PrefixLayout(prefix.embeds.shape[0], prefix.n_image)
    ranges = {n: layout.query_rows(n, 5) for n in (POST_VISION, ALL_ROWS, WINDOW)}
    slot, b = m.arena.allocate(), model.cfg.backbone
    seen = []

    def spy(layer, q, k_cache):  # what the recorder is given, for the reference below
        seen.append((q[: layout.n_rows].clone(), k_cache[slot, : layout.n_rows].clone()))
        rec(layer, q, k_cache)

    rec = StatsRecorder(layout, slot, ranges, b.layers, model.backbone.scale, 0.01, b.heads,
                        model.device, kernel=kernel)  # fmt: skip
    model.prefill(m.arena, slot, prefix, observer=spy)
    assert rec.queries[ALL_ROWS].shape[:2] == (b.layers, layout.n_rows)
    stats = rec.stats()
    for name, (a, z) in ranges.items():
        for layer, (q, k) in enumerate(seen):
            col, below = attn_stats_ref(q[a:z], k, model.backbone.scale, 0.01)
            per_kv = col.view(b.kv_heads, -1, layout.n_rows).sum(1)  # each KV head's group
            torch.testing.assert_close(stats.scores[name][layer], per_kv)
            if name == POST_VISION:
                want = (below.double() / ((z - a) * layout.n_rows)).mean()
                assert abs(float(stats.sparsity[layer]) - float(want)) < 1e-12


def test_decode_after_compression_equals_a_cache_of_only_those_rows(model):
    """Bytes: the compacted slot decodes exactly like a slot whose rows were written from the
    selected rows alone (same per-layer lengths, same positions)."""
    m, fp = frame(model, CompressConfig(budget=0.1, method="pyramidkv"), seed=2)
    arena, sel = m.arena, m.selection(fp)
    full_k, full_v = arena.k[:, fp.slot].clone(), arena.v[:, fp.slot].clone()
    m.create(fp, "q", TaskKind.ANSWER, 4, [5])
    built = arena.allocate()
    arena.k[:, built].normal_()  # stale rows past each length must not matter
    arena.v[:, built].normal_()
    for layer, keep in enumerate(sel.keep):
        n = keep.shape[1]
        for h, rows in enumerate(keep):  # written head by head from that head's rows
            arena.k[layer, built, :n, h] = full_k[layer, rows, h]
            arena.v[layer, built, :n, h] = full_v[layer, rows, h]
        arena.length[layer, built] = n
    arena.next_pos[built] = sel.layout.n_rows
    question = torch.tensor([10, 20, 30, 40, 50])
    ids_a, raw_a = greedy(model, arena, fp.slot, question, 12)
    ids_b, raw_b = greedy(model, arena, built, question, 12)
    assert ids_a == ids_b and raw_a == raw_b
    assert arena.length[:, fp.slot].tolist() == arena.length[:, built].tolist()


def test_budget_one_is_byte_identical_to_no_compression(model):
    """α = 1.0 records nothing and compacts nothing: arena bytes and logits as without."""
    outs = []
    for cfg in (None, CompressConfig(budget=1.0), CompressConfig(budget=0.3, method="full")):
        m, fp = frame(model, cfg, seed=3)
        assert fp.pending is None and m.selection(fp) is None
        req = m.create(fp, "q", TaskKind.ANSWER, 4, [7, 8, 9])
        ids, raw = greedy(model, m.arena, req.slot, torch.tensor([1, 2]), 6)
        n = m.arena.slot_len(req.slot)
        outs.append((ids, raw, m.arena.k[:, req.slot, :n].clone(), m.arena.length.clone()))
    for ids, raw, k, length in outs[1:]:
        assert ids == outs[0][0] and raw == outs[0][1]
        assert torch.equal(k, outs[0][2]) and torch.equal(length, outs[0][3])


def test_keeping_every_row_is_the_identity(model):
    m, fp = frame(model, CompressConfig(budget=0.5), seed=4)
    layout = m.selection(fp).layout
    k, v = m.arena.k.clone(), m.arena.v.clone()
    compact(m.arena, fp.slot, every_row(layout))
    assert torch.equal(m.arena.k, k) and torch.equal(m.arena.v, v)
    assert m.arena.length[:, fp.slot].tolist() == [layout.n_rows] * 4


def test_a_bad_compaction_changes_nothing(model):
    m, fp = frame(model, CompressConfig(budget=0.2), seed=5)
    arena, s = m.arena, fp.slot
    sel = m.selection(fp)
    model.append(arena, s, torch.tensor([3, 4]))  # the slot no longer holds just the prefix
    state = (arena.k.clone(), arena.v.clone(), arena.length.clone(), arena.next_pos.clone())
    with pytest.raises(ValueError, match="not exactly"):
        compact(arena, s, sel)
    arena.truncate(s, fp.prefix_len)
    bad = Selection(sel.layout, (torch.tensor([0, 999]).expand(KV_HEADS, -1),) * 4)
    with pytest.raises(ValueError, match="outside"):
        compact(arena, s, bad)
    one_head = Selection(sel.layout, (torch.tensor([[0, 1]]),) * 4)
    with pytest.raises(ValueError, match="KV heads"):
        compact(arena, s, one_head)
    assert torch.equal(arena.k, state[0]) and torch.equal(arena.v, state[1])
    assert arena.length[:, s].tolist() == [fp.prefix_len] * 4


def test_expert_on_a_compressed_prefix(model):
    """compress_expert: the expert reads each layer's kept rows; keeping every row gives the
    full prefix's chunk byte for byte, keeping 10% another chunk."""
    m, fp = frame(model, CompressConfig(budget=0.1), seed=6)
    noise = model.make_noise(0)
    full = model.sample_actions(m.arena, fp.slot, fp.prefix_len, noise)
    layout = m.selection(fp).layout
    compact(m.arena, fp.slot, every_row(layout))
    same = model.sample_actions(m.arena, fp.slot, fp.prefix_len, noise, compressed=True)
    assert same.numpy().tobytes() == full.numpy().tobytes()
    m2, fp2 = frame(model, CompressConfig(budget=0.1, compress_expert=True), seed=6)
    assert fp2.compressed and m2.arena.length[:, fp2.slot].max() < fp2.prefix_len
    small = model.sample_actions(m2.arena, fp2.slot, fp2.prefix_len, noise, compressed=True)
    assert small.shape == full.shape and not torch.equal(small, full)
    with pytest.raises(ValueError, match="prefix_len"):
        model.sample_actions(m2.arena, fp2.slot, fp2.prefix_len, noise)  # not flagged


def test_kernels_read_each_layers_kept_rows(model):
    """A decode step over a compressed slot and a full one: per layer, both Triton kernels
    (interpreter) equal the reference with that layer's kv_len; a compressed layer reads its
    kept rows only (NaN past them would poison the output if read)."""
    from embodied_kv.kernels.packed_attention import packed_attention_kernel, packed_attention_ref
    from embodied_kv.kernels.triton_base import INTERPRETED
    from embodied_kv.storage.step import Segment, plan_step

    if not INTERPRETED:  # CPU tensors: the kernels run on them under the interpreter only
        pytest.skip("needs TRITON_INTERPRET=1 (the Triton kernels on this test's CPU tensors)")
    m, fp = frame(model, CompressConfig(budget=0.1, method="pyramidkv"), seed=7)
    m.create(fp, "q", TaskKind.ANSWER, 4, [5])
    arena = m.arena
    full = arena.allocate()
    model.prefill(arena, full, model.embed_prefix(synthetic_observation(model.cfg, 8)))
    plan = plan_step(arena, [Segment(fp.slot, 1), Segment(full, 1)])
    b = model.cfg.backbone
    q = torch.randn(plan.n_padded, b.heads, b.head_dim, generator=torch.Generator().manual_seed(0))
    n = plan.n_real
    refs = []
    for layer in range(4):
        kv_len = plan.kv_len[layer][:n]
        assert int(kv_len[0]) == int(arena.length[layer, fp.slot]) + 1 < int(kv_len[1])
        args = (q[:n], arena.k[layer], arena.v[layer], plan.slot[:n], kv_len, model.backbone.scale)
        refs.append(packed_attention_ref(*args))  # before the scribble: it pads keys to 64
    for layer in range(4):  # row `length` is where the step writes the token's own K/V
        arena.k[layer, fp.slot, int(arena.length[layer, fp.slot]) + 1 :] = float("nan")
        arena.v[layer, fp.slot, int(arena.length[layer, fp.slot]) + 1 :] = float("nan")
    for layer, ref in enumerate(refs):
        kv_len = plan.kv_len[layer][:n]
        args = (q[:n], arena.k[layer], arena.v[layer], plan.slot[:n], kv_len, model.backbone.scale)
        for decode in (True, False):
            out = packed_attention_kernel(*args, decode=decode)
            assert not out.isnan().any()
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
