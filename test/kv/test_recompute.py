"""Cached memory KV placed in a plan prompt: re-rotation, selective recomputation and the
baselines, against full recomputation over the same token ids."""

import tempfile
from pathlib import Path

import pytest
import torch

from embodied_kv.kv import recompute
from embodied_kv.kv.compress import PrefixLayout, Selection, compact
from embodied_kv.kv.memory import MemoryConfig, MemoryOp, SegmentMemory
from embodied_kv.kv.memory_kv import compute_block, encode, layout, rerotate
from embodied_kv.kv.memory_methods import FullRecompute, PrefixCaching, Selective, keep, methods
from embodied_kv.kv.selectors import CacheBlendSelector, FixedSelector, KeepConfig
from embodied_kv.model.trained import TOKENIZER_FILE, world_config
from embodied_kv.model.vla import StepInput, build_model
from embodied_kv.model.word_tokenizer import save_tokenizer

from .conftest import PerSegmentLoader

FACTS = ["the red box is on the shelf .", "the blue key is in the red box .",
         "the green bowl is on the table .", "the red box is open .",
         "the yellow ball is in the green bowl .", "the green bowl is closed ."]  # fmt: skip
GOAL = "where is the blue key ?"
ROPE_TOL = 2e-5  # fp32 rounding of two rotations vs one, relative to |k|


class Rig:
    """A frame prefix in one slot, a work slot for blocks, slots for requests."""

    def __init__(self, model, window=2):
        self.model = model
        self.arena = model.new_arena(5, 256)
        self.frame, self.work, self.cache = (self.arena.allocate() for _ in range(3))
        g = torch.Generator().manual_seed(0)
        prefix = torch.randn(24, model.cfg.backbone.width, generator=g)
        model.step(self.arena, [StepInput(self.frame, embeds=prefix, causal=False)])
        self.memory = SegmentMemory(MemoryConfig(window=window))
        for i, f in enumerate(FACTS):
            self.memory.apply(MemoryOp.ADD, f"f{i}", f, 64, group=" ".join(f.split()[1:3]))
        self.memory.apply(MemoryOp.UPDATE, "f5", "the green bowl is open .", 64)
        self.memory.apply(MemoryOp.UPDATE, "f5", "the green bowl is closed .", 64)
        self.refresh()

    def refresh(self):
        self.memory.refresh(lambda t: compute_block(self.model, self.arena, self.work, t))

    def layout(self, goal=GOAL):
        return layout(self.model, self.memory.units(), self.memory.blocks, goal)

    def run(self, method, lay=None, frame=0):
        """-> (logits, the request slot's K and V rows) of one plan request."""
        slot = self.arena.allocate()
        self.arena.copy_slot(self.frame, slot)
        lay = lay or self.layout()
        logits = method.prefill(self.model, self.arena, slot, lay, frame)
        n = self.arena.slot_len(slot)
        out = logits, self.arena.k[:, slot, :n].clone(), self.arena.v[:, slot, :n].clone()
        if isinstance(method, PrefixCaching):
            method.remember(self.arena, slot, lay, frame)
        self.arena.release(slot)
        return out


@pytest.mark.parametrize("delta", [37, -5])
def test_a_rerotated_cached_segment_equals_the_segment_prefilled_at_its_new_offset(
    world_model, delta
):
    arena = world_model.new_arena(2, 128)
    ids = torch.tensor(encode(world_model, "\nFacts: the red box is on the shelf ."))
    a, b = arena.allocate(), arena.allocate()
    arena.next_pos[a] = 10
    arena.next_pos[b] = 10 + delta
    for s in (a, b):
        world_model.step(arena, [StepInput(s, ids=ids)])
    n, rope = len(ids), world_model.backbone.rope
    for layer in range(arena.spec.num_layers):
        moved = rerotate(rope, arena.k[layer, a, :n], torch.full((n,), delta))
        fresh = arena.k[layer, b, :n]
        scale = fresh.abs().max()
        assert (moved - fresh).abs().max() <= ROPE_TOL * scale
        assert (arena.v[layer, a, :n] - arena.v[layer, b, :n]).abs().max() <= ROPE_TOL * scale
    assert not torch.equal(arena.k[1, a, :n], arena.k[1, b, :n])  # the offset did matter


def test_keep_at_ratio_one_everywhere_is_full_recomputation_in_bytes(world_model):
    rig = Rig(world_model)
    assert any(u.key.startswith("group:") for u in rig.memory.units())  # a joint block too
    full = rig.run(FullRecompute())
    everything = keep(KeepConfig(ratios=(1.0,) * world_model.cfg.backbone.layers))
    got = rig.run(everything)
    for x, y in zip(got, full, strict=True):
        assert torch.equal(x, y)
    assert everything.stats.active == [rig.layout().n] * world_model.cfg.backbone.layers


def compressed_run(rig, method, kept=(24, 17, 9, 13), lay=None):
    """One plan request over a frame prefix compacted by VL-Cache's `compact` (rows
    [0, 16) an image, a different share of them kept in each layer and KV head) -> (the
    slot's per-layer lengths before the request, logits, per-layer K and V rows)."""
    arena, model = rig.arena, rig.model
    slot = arena.allocate()
    arena.copy_slot(rig.frame, slot)
    g = torch.Generator().manual_seed(1)
    heads, layout_ = arena.spec.kv_heads, PrefixLayout(24, 16)
    keep_rows = tuple(
        torch.stack([torch.cat([torch.randperm(16, generator=g)[: k - 8].sort().values,
                                torch.arange(16, 24)]) for _ in range(heads)])
        for k in kept[: arena.spec.num_layers]
    )  # fmt: skip
    compact(arena, slot, Selection(layout_, keep_rows))
    before = arena.length[:, slot].tolist()
    lay = lay or rig.layout()
    logits = method.prefill(model, arena, slot, lay)
    if isinstance(method, PrefixCaching):
        method.remember(arena, slot, lay, 0)
    n = arena.length[:, slot].tolist()
    k = [arena.k[i, slot, : n[i]].clone() for i in range(len(n))]
    v = [arena.v[i, slot, : n[i]].clone() for i in range(len(n))]
    arena.release(slot)
    return before, logits, k, v


def test_over_a_compressed_prefix_keep_at_ratio_one_is_full_recomputation_in_bytes(world_model):
    """VL-Cache leaves the frame's layers with different row counts: prompt token t sits
    at row length[l] + t of layer l. With every ratio 1.0 KEEP's selective prefill is
    full recomputation over that slot, byte for byte in every layer."""
    rig = Rig(world_model)
    layers = world_model.cfg.backbone.layers
    before, *full = compressed_run(rig, FullRecompute())
    assert len(set(before)) == layers  # a row count per layer
    everything = keep(KeepConfig(ratios=(1.0,) * layers))
    _, logits, k, v = compressed_run(rig, everything)
    assert torch.equal(logits, full[0])
    assert all(torch.equal(a, b) for a, b in zip(k + v, full[1] + full[2], strict=True))


@pytest.mark.parametrize("name", ["reuse", "keep", "keep-no-balance", "cacheblend", "prefix"])
def test_over_a_compressed_prefix_each_layer_gets_its_cached_rows_at_its_own_offset(
    world_model, monkeypatch, name
):
    """Every method over a compressed prefix: the prefix rows untouched in every layer,
    the same bytes as the per-segment reference loader (which places a unit by hand at
    slot row + the layer's shift), and under full reuse every segment row of every layer
    is its block's row re-rotated to the new position."""
    rig = Rig(world_model)
    method = next(m for m in methods(rig.cache) if m.name == name)
    lay = rig.layout()
    before, logits, k, v = compressed_run(rig, method)
    prefix = compressed_run(rig, NoPrompt())[2:]  # the compacted rows alone
    for layer, n in enumerate(before):
        assert torch.equal(k[layer][:n], prefix[0][layer][:n])
        assert torch.equal(v[layer][:n], prefix[1][layer][:n])
    if isinstance(method, Selective):
        monkeypatch.setattr(recompute, "LayerLoader", PerSegmentLoader)
        _, *want = compressed_run(rig, method)
        assert torch.equal(logits, want[0])
        assert all(torch.equal(a, b) for a, b in zip(k + v, want[1] + want[2], strict=True))
    if name != "reuse":
        return
    rope, pos0 = world_model.backbone.rope, 24
    for p in lay.placed:
        for (start, m), (brow, _) in zip(p.pieces, p.block.spans, strict=True):
            delta = torch.full((m,), pos0 + start - (p.block.pos0 + brow))
            for layer, n in enumerate(before):
                want_k = rerotate(rope, p.block.k[layer, brow : brow + m], delta)
                got_k = k[layer][n + start : n + start + m]
                assert (got_k - want_k).abs().max() <= ROPE_TOL * want_k.abs().max()
                assert torch.equal(v[layer][n + start : n + start + m],
                                   p.block.v[layer, brow : brow + m])  # fmt: skip


def test_over_a_compressed_prefix_prefix_caching_copies_each_layer_at_its_own_rows(world_model):
    rig = Rig(world_model)
    prefix = PrefixCaching(rig.cache)
    compressed_run(rig, prefix)
    rig.memory.apply(MemoryOp.UPDATE, "f4", "the yellow ball is in the red box .", 64)
    rig.refresh()
    lay = rig.layout("where is the yellow ball ?")
    got = compressed_run(rig, prefix, lay=lay)
    want = compressed_run(rig, FullRecompute(), lay=lay)
    assert prefix.reused > 0
    assert torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2] + got[3], want[2] + want[3], strict=True))


def test_over_a_compressed_prefix_keep_scores_each_layer_at_its_own_rows(world_model):
    """KEEP's segment attention at layer i reads layer i's rows: there the prompt starts
    at that layer's own row count, not layer 0's."""
    from embodied_kv.kv import selectors

    rig = Rig(world_model)
    seen = []

    class Spy(selectors.KeepSelector):
        def _multi_hop(self, view, lay, segs, cand, k):
            seen.append((view, segs, lay, cand.tolist()))
            return super()._multi_hop(view, lay, segs, cand, k)

    before, *_ = compressed_run(rig, Selective("keep", True, lambda n: Spy(KeepConfig(), n)))
    assert any(before[v.layer] != before[0] for v, *_ in seen)  # a layer at another row0
    for view, segs, lay, cand in seen:
        assert view.row0 == before[view.layer]
        row = {t: j for j, t in enumerate(view.tokens.tolist())}
        query = [row[t] for t in range(lay.query_start, lay.n)]
        spans = [lay.segments()[c] for c in cand]
        mass = selectors.attention_mass(view, torch.tensor(query), segs)[:, cand]
        assert torch.equal(mass, attention_mass_per_span(view, query, spans))


class NoPrompt:
    """No prompt at all: leaves the compacted prefix as it is (the reference rows)."""

    def prefill(self, model, arena, slot, lay):
        return None


def test_keep_recomputes_whole_segments_fewer_with_depth(world_model):
    rig = Rig(world_model)
    lay = rig.layout()
    method = keep(KeepConfig(first_ratio=0.5, last_ratio=0.2))
    rig.run(method, lay)
    fixed, spans = len(lay.fixed()), [n for _, n in lay.segments()]
    active = method.stats.active
    assert active[0] == lay.n and active == sorted(active, reverse=True) and active[-1] > fixed
    for count in active[1:]:  # header + query + a set of whole segments
        extra = count - fixed
        sums = {0}
        for n in spans:
            sums |= {s + n for s in sums}
        assert extra in sums


def test_multi_hop_selection_is_a_fixed_point_and_one_hop_is_the_query_alone(world_model):
    from embodied_kv.kv import selectors

    rig = Rig(world_model)
    lay = rig.layout()
    seen = {}

    class Spy(selectors.KeepSelector):
        def _multi_hop(self, view, lay, segs, cand, k):
            chosen = super()._multi_hop(view, lay, segs, cand, k)
            picked = set(cand[chosen].tolist())
            seen.setdefault(self.cfg.hops, []).append((view, segs, cand.tolist(), k, picked))
            return chosen

    for hops in (0, 50):
        rig.run(Selective(f"h{hops}", True, lambda n, h=hops: Spy(KeepConfig(hops=h), n)), lay)
    for view, segs, cand, k, chosen in seen[50]:
        row = {t: j for j, t in enumerate(view.tokens.tolist())}
        query = [row[t] for t in range(lay.query_start, lay.n)]
        cs = [lay.segments()[c] for c in cand]
        last = [row[a + n - 1] for a, n in cs]  # every candidate's last token, one pass
        mass = selectors.attention_mass(view, torch.tensor(query + last), segs)[:, cand]
        assert torch.equal(mass, attention_mass_per_span(view, query + last, cs))
        mine = [j for j in range(len(cand)) if cand[j] in chosen]
        mass = mass.double()  # the selector's scores and means are fp64
        score = mass[: len(query)].mean(0) + mass[len(query) :][mine].mean(0)
        assert {cand[j] for j in selectors.top_segments(score, k).tolist()} == chosen  # stable
    for view, segs, cand, k, chosen in seen[0]:
        row = {t: j for j, t in enumerate(view.tokens.tolist())}
        query = torch.tensor([row[t] for t in range(lay.query_start, lay.n)])
        q_mass = selectors.attention_mass(view, query, segs)[:, cand].double().mean(0)
        assert {cand[j] for j in selectors.top_segments(q_mass, k).tolist()} == chosen


def attention_mass_per_span(view, src: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    """selectors.attention_mass one span at a time (the exactness reference): each span's
    exact sum (fp64) rounded once to fp32."""
    q = view.q[src].float()
    reach = max(view.row0 + max(a + n for a, n in spans), *(int(view.kv_len[j]) for j in src))
    k = view.arena.k[view.layer, view.slot, :reach].float()
    m, hq, d = q.shape
    scores = torch.einsum("mhgd,rhd->mhgr", q.view(m, k.shape[1], -1, d), k) * d**-0.5
    lens = view.kv_len[src]
    mask = torch.arange(reach)[None, :] >= lens[:, None]
    probs = scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1).mean((1, 2))
    rows = torch.tensor([view.row0 + a + j for a, n in spans for j in range(n)])
    owner = torch.tensor([s for s, (_, n) in enumerate(spans) for _ in range(n)])
    out = torch.zeros(m, len(spans), dtype=torch.float64)
    return out.index_add_(1, owner, probs.index_select(1, rows).double()).float()


@pytest.mark.parametrize("name", ["reuse", "cacheblend", "keep", "keep-one-hop", "keep-no-balance"])
def test_the_packed_loader_gives_the_bytes_of_per_segment_copies(world_model, monkeypatch, name):
    """The whole selective prefill with the packed loader and with the per-segment
    reference loader (conftest.py): the same logits, K and V, byte for byte."""
    rig = Rig(world_model)
    lay = rig.layout()
    method = next(m for m in methods(rig.cache) if m.name == name)
    got = rig.run(method, lay)
    monkeypatch.setattr(recompute, "LayerLoader", PerSegmentLoader)
    want = rig.run(method, lay)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


def test_full_reuse_computes_only_header_and_query_and_cacheblend_a_share(world_model):
    rig = Rig(world_model)
    lay = rig.layout()
    reuse = Selective("reuse", False, lambda n: FixedSelector())
    blend = Selective("cacheblend", False, lambda n: CacheBlendSelector(0.15))
    rig.run(reuse, lay)
    rig.run(blend, lay)
    fixed = len(lay.fixed())
    memory_tokens = lay.n - fixed
    assert reuse.stats.active == [fixed] * 4
    assert blend.stats.active == [lay.n] + [fixed + -(-memory_tokens * 15 // 100)] * 3


def test_prefix_caching_reuses_the_unchanged_prefix_and_stays_exact(world_model):
    rig = Rig(world_model)
    prefix, full = PrefixCaching(rig.cache), FullRecompute()
    rig.run(prefix, frame=7)
    assert prefix.reused == 0
    before = prefix.ids
    rig.memory.apply(MemoryOp.UPDATE, "f4", "the yellow ball is in the red box .", 64)
    rig.refresh()
    lay = rig.layout("where is the yellow ball ?")
    got, want = rig.run(prefix, lay, frame=7), rig.run(full, lay, frame=7)
    seg = next(p for p in lay.placed if "f4" in p.unit.segments)
    first_new = next(i for i, (a, b) in enumerate(zip(before, lay.ids, strict=False)) if a != b)
    assert prefix.reused == first_new and seg.start <= first_new < seg.start + seg.n
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rig.run(prefix, lay, frame=8)  # another frame's prefix: nothing is reused
    assert prefix.reused == 0


def test_every_method_fills_the_same_rows_and_the_family_is_complete(world_model):
    rig = Rig(world_model)
    lay = rig.layout()
    names = []
    for m in methods(rig.cache):
        logits, k, _ = rig.run(m, lay)
        assert logits.shape == (world_model.cfg.vocab_size,) and k.shape[1] == 24 + lay.n
        names.append(m.name)
    assert names == ["full", "prefix", "reuse", "cacheblend", "keep", "keep-no-static",
                     "keep-one-hop", "keep-no-balance"]  # fmt: skip


def test_the_image_cache_rewrites_only_changed_blocks_and_keeps_every_byte(world_model):
    """A method keeps its last request's host image and copies in only the blocks an
    update replaced; every request's logits and KV equal those of a fresh pack."""
    rig = Rig(world_model)
    cached = keep()
    written = []
    for i, text in enumerate(["the green bowl is open .", "the green bowl is closed .",
                              "the green bowl is open .", "the red box is on the table .",
                              "the red box is on the big shelf ."]):  # fmt: skip
        key = "f0" if "red box" in text else "f5"
        rig.memory.apply(MemoryOp.UPDATE, key, text, 65 + i)
        rig.refresh()
        lay = rig.layout()
        got = rig.run(cached, lay)
        want = rig.run(keep(), lay)  # a new method: its image packed from the blocks
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)
        written.append(cached.images.written_rows)
    total = cached.images.k.shape[1]
    rows_f5 = len(encode(world_model, " the green bowl is open ."))
    assert rows_f5 in written[1:3]  # same shape after an open/closed flip: one segment
    assert written[-1] == total  # a longer fact shifts every row after it: packed anew
    assert min(written) < total / 3


def test_the_image_cache_never_writes_into_a_block():
    from embodied_kv.kv.host_image import ImageCache, Source, pack
    from embodied_kv.kv.memory import KVBlock
    from embodied_kv.model.layers import Rope

    rope = Rope(8, 64, 1e4)
    rope.reset_tables()
    g = torch.Generator().manual_seed(0)

    def block(n):
        return KVBlock(torch.randn(2, n, 1, 8, generator=g), torch.randn(2, n, 1, 8, generator=g),
                       3, ((0, n),))  # fmt: skip

    a, b, c = block(4), block(3), block(3)
    cache = ImageCache()
    for blocks in ([a], [a, b], [a, c], [c, a]):
        before = [(x.k.clone(), x.v.clone()) for x in blocks]
        sources, row = [], 10
        for x in blocks:
            sources.append(Source(x, 0, row, x.rows, 2))
            row += x.rows
        got, want = cache.pack(sources, rope, torch.device("cpu")), pack(
            sources, rope, torch.device("cpu"))  # fmt: skip
        for name in ("k", "v", "unit", "slot_row", "cos", "sin"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.start == want.start
        assert got.k.data_ptr() not in {x.k.data_ptr() for x in blocks}
        for x, (k, v) in zip(blocks, before, strict=True):
            assert torch.equal(x.k, k) and torch.equal(x.v, v)
    assert cache.pack([], rope, torch.device("cpu")) is None  # a reset memory
    assert cache.k is None and cache.pieces == []  # holds no block any more


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA loader needs a CUDA device")
@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("name", ["keep", "keep-no-balance", "cacheblend", "reuse"])
def test_on_cuda_the_staged_side_stream_loader_gives_the_reference_bytes(monkeypatch, name,
                                                                         compressed):  # fmt: skip
    """The CUDA path itself (pinned image, one async range copy per layer and K/V into a
    staging buffer on the copy stream, events, the image cache's fence) against the
    per-segment reference loader on the same device, over a stream of updates; also over
    a VL-Cache-compacted prefix (a row shift per layer)."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
        model = build_model(world_config(), "cuda", tokenizer_path=str(tok))
    rig = Rig(model)
    method = next(m for m in methods(rig.cache) if m.name == name)
    for i, text in enumerate(["the green bowl is open .", "the green bowl is closed .",
                              "the red box is on the table ."]):  # fmt: skip
        rig.memory.apply(MemoryOp.UPDATE, "f0" if "red box" in text else "f5", text, 65 + i)
        rig.refresh()
        lay = rig.layout()
        run = (lambda m, lay: compressed_run(rig, m, lay=lay)[1:]) if compressed else rig.run
        got = flat(run(method, lay))
        with monkeypatch.context() as m:
            m.setattr(recompute, "LayerLoader", PerSegmentLoader)
            want = flat(run(next(x for x in methods(rig.cache) if x.name == name), lay))
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)


def flat(out) -> list[torch.Tensor]:
    """(logits, K, V) with K and V a tensor or a list per layer -> one list of tensors."""
    return [t for x in out for t in (x if isinstance(x, list) else [x])]
