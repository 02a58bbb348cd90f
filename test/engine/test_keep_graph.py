"""KEEP's prefill replayed from graphs (engine/keep_graph.py), through the graph code
path on the CPU (GraphRunner "emulate": host values frozen at capture, host reads
refused, every replay over the static buffers), against eager KEEP and full
recomputation."""

import collections
import tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from embodied_kv.bench.keep_stream import Stream
from embodied_kv.engine.graphs import GraphRunner
from embodied_kv.engine.keep_graph import GraphKeep, graph_shape, narrowing, with_room
from embodied_kv.kernels.packed_attention import CUDA_ROW_BUCKET, bucket
from embodied_kv.kv.memory import MemoryConfig, MemoryOp, SegmentMemory, piece
from embodied_kv.kv.memory_kv import compute_block, encode, layout
from embodied_kv.kv.memory_methods import FullRecompute, keep
from embodied_kv.kv.selectors import KeepConfig
from embodied_kv.model.trained import TOKENIZER_FILE, world_config
from embodied_kv.model.vla import StepInput, build_model
from embodied_kv.model.word_tokenizer import save_tokenizer


class StreamRig:
    """A frame prefix, a memory of `n` world facts fed a stream of updates, and plan
    requests over it, each in a fresh copy of the frame's slot."""

    def __init__(self, model, n: int, seed: int):
        self.model = model
        self.arena = model.new_arena(5, 512)
        self.frame, self.work = self.arena.allocate(), self.arena.allocate()
        g = torch.Generator().manual_seed(seed)
        prefix = torch.randn(24, model.cfg.backbone.width, generator=g)
        model.step(self.arena, [StepInput(self.frame, embeds=prefix, causal=False)])
        self.stream = Stream.make(n, seed)
        self.memory = SegmentMemory(MemoryConfig(window=3))
        for key, text, group in self.stream.segments():
            self.memory.apply(MemoryOp.ADD, key, text, n, group)

    def next_layout(self, request: int):
        for _ in range(2):
            key, text, group = self.stream.update()
            self.memory.apply(MemoryOp.UPDATE, key, text, 100 + request, group)
        self.memory.refresh(lambda t: compute_block(self.model, self.arena, self.work, t))
        texts = [t for u in self.memory.units() for t in u.texts]
        goal, _ = self.stream.query(1 + request % 2, texts)
        return layout(self.model, self.memory.units(), self.memory.blocks, goal)

    def layout_of(self, blocks, goal="where is the red box ?"):
        return layout(self.model, self.memory.units(), blocks, goal)

    def run(self, method, lay):
        """-> (logits, the request slot's K and V rows)."""
        slot = self.arena.allocate()
        self.arena.copy_slot(self.frame, slot)
        logits = method.prefill(self.model, self.arena, slot, lay)
        n = self.arena.slot_len(slot)
        out = logits, self.arena.k[:, slot, :n].clone(), self.arena.v[:, slot, :n].clone()
        self.arena.release(slot)
        return out


def test_at_ratio_one_the_graph_is_full_recomputation_in_bytes(world_model):
    rig = StreamRig(world_model, 10, seed=1)
    cfg = KeepConfig(first_ratio=1.0, last_ratio=1.0)
    graphed = GraphKeep(GraphRunner(world_model, rig.arena, "emulate"), cfg)
    for r in range(3):
        lay = rig.next_layout(r)
        got, want = rig.run(graphed, lay), rig.run(FullRecompute(), lay)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)
        assert graphed.stats.active == [lay.n] * len(world_model.backbone.layers)


@pytest.mark.parametrize("hops,ratios", [(3, ()), (0, ()), (3, (1.0, 0.5, 0.0, 0.0))])
def test_replays_choose_what_eager_keep_chooses_over_a_stream_of_updates(world_model, hops,
                                                                         ratios):  # fmt: skip
    """Each request changes the memory (two updates) and the goal; a replay must read the
    new request's values, never the captured ones: the same segments per layer as eager
    KEEP, the same logits (to fp32 rounding: the graph's softmax spans the whole slot),
    and captures shared between requests."""
    cfg = KeepConfig(hops=hops, ratios=ratios)  # the last: no segment after layer 1
    rig = StreamRig(world_model, 20, seed=2 + hops)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    graphed, eager = GraphKeep(runner, cfg), keep(cfg)
    shapes = set()
    for r in range(6):
        lay = rig.next_layout(r)
        shapes.add(graph_shape(lay, cfg, len(world_model.backbone.layers)))
        got, want = rig.run(graphed, lay), rig.run(eager, lay)
        assert graphed.stats.active == eager.stats.active
        assert eager.stats.active[-1] < lay.n  # the selection narrowed
        assert int(got[0].argmax()) == int(want[0].argmax())
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert len(graphed.graphs) == runner.captures <= len(shapes) < 6  # shared captures
    assert runner.replays == 6


def test_a_replay_reads_the_new_layout_when_the_shape_is_the_same(world_model):
    """Two facts of different lengths swap texts: the prompt keeps its shape (tokens,
    segments, lengths) but every index after the first swapped fact moves. The replay
    must place, score and narrow by the new positions."""
    rig = StreamRig(world_model, 12, seed=4)
    graphed, eager = GraphKeep(GraphRunner(world_model, rig.arena, "emulate")), keep()
    lay = rig.next_layout(0)
    rig.run(graphed, lay)
    facts = rig.stream.segments()  # (segment id, text, group)
    size = {t: len(encode(world_model, piece(t))) for _, t, _ in facts}
    a, b = next((x, y) for x in facts for y in facts if size[x[1]] != size[y[1]])
    for (key, _, group), (_, text, _) in ((a, b), (b, a)):
        rig.memory.apply(MemoryOp.UPDATE, key, text, 200, group)
    rig.memory.refresh(lambda t: compute_block(world_model, rig.arena, rig.work, t))
    swapped = layout(world_model, rig.memory.units(), rig.memory.blocks, "where is the red box ?")
    assert swapped.segments() != lay.segments() and swapped.n == lay.n
    got, want = rig.run(graphed, swapped), rig.run(eager, swapped)
    assert len(graphed.graphs) == 1 and graphed.runner.replays == 2  # the same capture
    assert graphed.stats.active == eager.stats.active
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_the_shape_bounds_every_selection_and_follows_the_ratios(world_model):
    rig = StreamRig(world_model, 30, seed=5)
    lay = rig.next_layout(0)
    cfg = KeepConfig(first_ratio=0.5, last_ratio=0.2)
    shape = graph_shape(lay, cfg, 4)
    s = len(lay.segments())
    assert shape.keep == (s, 15, 11, 6) and shape.segments == s == 30  # ceil(r x 30)
    longest = sorted((n for _, n in lay.segments()), reverse=True)
    fixed = lay.n - sum(longest)
    for k, rows in zip(shape.keep[1:], shape.rows[1:], strict=True):
        assert fixed + sum(longest[:k]) <= rows <= shape.n_pad  # any k segments fit
    assert shape.query == lay.n - lay.query_start


def test_without_a_cached_block_or_over_another_arena_it_runs_eager_keep(world_model):
    rig = StreamRig(world_model, 10, seed=3)
    lay = rig.next_layout(0)
    key = lay.placed[0].unit.key
    blocks = {k: b for k, b in rig.memory.blocks.items() if k != key}
    lay = rig.layout_of(blocks)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    got, want = rig.run(GraphKeep(runner), lay), rig.run(keep(), lay)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    elsewhere = GraphRunner(world_model, world_model.new_arena(2, 64), "emulate")
    got = rig.run(GraphKeep(elsewhere), rig.layout_of(rig.memory.blocks))  # not its arena
    want = rig.run(keep(), rig.layout_of(rig.memory.blocks))
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    assert runner.captures == elsewhere.captures == 0


@pytest.mark.parametrize("ratios", ["all", "default"])
def test_over_a_compressed_prefix_the_graph_places_each_layer_at_its_own_rows(world_model,
                                                                              ratios):  # fmt: skip
    """A slot whose layers hold different row counts (VL-Cache compacted the frame's
    prefix): the graph's image rows go to each layer's own offset. Every ratio 1.0: full
    recomputation's bytes; default ratios: eager KEEP's choice per layer and its logits,
    and the uncompressed shape's graph serves (no capture of its own)."""
    layers = len(world_model.backbone.layers)
    cfg = KeepConfig(ratios=(1.0,) * layers) if ratios == "all" else KeepConfig()
    rig = StreamRig(world_model, 20, seed=4)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    graphed = GraphKeep(runner, cfg)
    want_method = FullRecompute() if ratios == "all" else keep(cfg)
    for r, drop in enumerate([(0, 0, 0, 0), (0, 5, 11, 3), (0, 2, 7, 9)]):
        lay = rig.next_layout(r)
        got, want = (compressed(rig, m, lay, drop[:layers]) for m in (graphed, want_method))
        if ratios == "all":
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        else:
            assert graphed.stats.active == want_method.stats.active
            assert int(got[0].argmax()) == int(want[0].argmax())
            for x, y in zip(got, want, strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert runner.replays == 3 and runner.captures <= 2


def compressed(rig, method, lay, drop) -> list[torch.Tensor]:
    """One request over the frame's prefix with its last `drop[l]` rows of layer l gone
    (as compaction leaves it) -> [logits, K rows of each layer]."""
    slot = rig.arena.allocate()
    rig.arena.copy_slot(rig.frame, slot)
    rig.arena.length[:, slot] -= torch.tensor(drop)
    logits = method.prefill(rig.model, rig.arena, slot, lay)
    n = rig.arena.length[:, slot].tolist()
    out = [logits] + [rig.arena.k[i, slot, : n[i]].clone() for i in range(len(n))]
    rig.arena.release(slot)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs CUDA")
def test_on_cuda_the_captured_graph_chooses_what_eager_keep_chooses():
    """The product path: torch.cuda.graph capture of the whole prefill, replayed over a
    stream of updates, against eager KEEP on the same device (bf16 arena)."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
        model = build_model(world_config(), "cuda", tokenizer_path=str(tok))
    rig = StreamRig(model, 40, seed=7)
    graphed, eager = GraphKeep(GraphRunner(model, rig.arena, "cuda")), keep()
    same = 0  # requests where both chose the same segments (index_add_ on CUDA is atomic:
    for r in range(6):  # a near tie may fall either way in either path)
        lay = rig.next_layout(r)
        got, want = rig.run(graphed, lay), rig.run(eager, lay)
        if graphed.stats.active == eager.stats.active:
            same += 1
            torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    assert same >= 5 and len(graphed.graphs) < 6

class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.names = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_replayed_request_dispatches_the_same_few_host_ops_at_10_and_40_segments(world_model):
    """What a request costs the host around its one graph launch (the layout's copies
    into the static buffers, the image's changed blocks): ~110 ops whatever
    the segments, against eager KEEP's ~900 (kv/test_prefill_host_work.py)."""
    host = {}
    for n in (10, 40):
        rig = StreamRig(world_model, n, seed=n)
        graphed = GraphKeep(GraphRunner(world_model, rig.arena, "emulate"))
        lay = rig.next_layout(0)
        rig.run(graphed, lay)  # captures
        buf = next(iter(graphed.graphs.values()))
        recorded, launches = buf.replay, []

        def launch(recorded=recorded, launches=launches):
            launches.append(1)
            with _disable_current_modes():  # the replay is one graph launch on CUDA
                recorded()

        buf.replay = launch
        slot = rig.arena.allocate()
        rig.arena.copy_slot(rig.frame, slot)
        with _Ops() as ops:
            graphed.prefill(world_model, rig.arena, slot, lay)
        host[n] = ops.count
        assert launches == [1]
    assert host[40] == host[10] < 120, (host, ops.names.most_common(12))


def grow(rig, count: int, goal: str = "where is the red box ?"):
    """Add facts to the rig's memory until it holds `count` -> the request's layout."""
    have = len(rig.memory.units()) and sum(len(u.texts) for u in rig.memory.units())
    for i in range(have, count):
        rig.memory.apply(MemoryOp.ADD, f"extra/{i}", "the red box is open .", 300 + i, "extra")
    rig.memory.refresh(lambda t: compute_block(rig.model, rig.arena, rig.work, t))
    return rig.layout_of(rig.memory.blocks, goal)


def test_a_growing_memory_and_queries_of_other_lengths_replay_one_capture(world_model):
    """A robot's memory grows by a fact at a time and its plan queries differ in length:
    one capture (room up to the next multiple of 8 segments and 16 query tokens) serves
    them all, each with eager KEEP's choice per layer and its logits."""
    rig = StreamRig(world_model, 10, seed=9)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    graphed = GraphKeep(runner)
    goals = ["where is the red box ?", "where is the blue key ?", "where is the box ?",
             "where is the red box now ?", "where is it ?", "where is the green ball ?"]
    lays = [grow(rig, 10 + i, goal) for i, goal in enumerate(goals)]
    assert len({(len(lay.segments()), lay.n - lay.query_start) for lay in lays}) == 6
    for lay in lays:
        eager = keep()
        got, want = rig.run(graphed, lay), rig.run(eager, lay)
        assert graphed.stats.active == eager.stats.active
        assert eager.stats.active[-1] < lay.n  # the selection narrowed
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert runner.captures == 1 and runner.replays == 6
    room = next(iter(graphed.graphs))
    assert room.segments == 16 and all(room.holds(graph_shape(lay, KeepConfig(), 4))
                                       for lay in lays)  # fmt: skip


def test_the_room_holds_what_it_promises_and_the_arena_bounds_it(world_model):
    rig = StreamRig(world_model, 12, seed=10)
    lay = rig.next_layout(0)
    need = graph_shape(lay, KeepConfig(), 4)
    room = with_room(lay, KeepConfig(), 4, rig.arena.spec.max_len)
    assert room.holds(need) and not need.holds(room)
    assert room.segments == 16 and room.query == bucket(need.query + 1, 16)
    assert room.keep == graph_shape(grow(rig, 16), KeepConfig(), 4).keep  # k_i at 16
    assert with_room(lay, KeepConfig(), 4, max_len=need.n_pad) == need  # no room: its own
    assert narrowing(KeepConfig(), 4) == (True, True, True, False)
    # a CUDA arena pads steps to 8 rows, not to the host CPU's probe (ROW_BUCKET, up to 32)
    cuda = graph_shape(lay, KeepConfig(), 4, CUDA_ROW_BUCKET)
    assert cuda.n_pad == bucket(lay.n, CUDA_ROW_BUCKET) and cuda.keep == need.keep
    assert with_room(lay, KeepConfig(), 4, rig.arena.spec.max_len, 8).n_pad % 8 == 0
    assert narrowing(KeepConfig(first_ratio=1.0, last_ratio=1.0), 4) == (False,) * 4
    assert narrowing(KeepConfig(ratios=(1.0, 0.5, 0.5, 0.2)), 4) == (True, False, True, False)


def test_the_graphs_kept_are_bounded_least_recently_used_first(world_model):
    """Graphs (and their buffers) are capped, the least recently used dropped; a request
    takes the smallest graph kept that holds it, so a larger memory's graph serves a
    smaller one."""
    rig = StreamRig(world_model, 10, seed=6)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    graphed = GraphKeep(runner, max_shapes=2)
    small, mid, big = (grow(rig, n) for n in (10, 17, 25))  # room: 16, 24, 32 segments
    for lay, captures, segments in [(small, 1, [16]), (mid, 2, [16, 24]), (small, 2, [24, 16]),
                                    (big, 3, [16, 32]), (mid, 3, [16, 32])]:  # fmt: skip
        got, want = rig.run(graphed, lay), rig.run(keep(), lay)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert runner.captures == captures
        assert [s.segments for s in graphed.graphs] == segments
    with pytest.raises(ValueError, match="at least one"):
        GraphKeep(runner, max_shapes=0)


def test_a_refused_capture_falls_back_to_eager_keep_for_good(world_model, monkeypatch):
    """A capture the device refuses (a CUDA error at capture) costs the plan nothing: the
    request and every later one run eager KEEP, and the reason is kept."""
    rig = StreamRig(world_model, 10, seed=8)
    runner = GraphRunner(world_model, rig.arena, "emulate")
    graphed = GraphKeep(runner)

    def refuse(fn):
        runner.captures += 1
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "graph_of", refuse)
    monkeypatch.setattr(runner, "mode", "cuda")  # emulation re-raises: a host read is a bug
    for r in range(2):
        lay = rig.next_layout(r)
        with pytest.warns(UserWarning, match="capture failed") if r == 0 else nullcontext():
            got = rig.run(graphed, lay)
        eager = keep()
        want = rig.run(eager, lay)
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y)
        assert graphed.stats.active == eager.stats.active
    assert runner.captures == 1 and "not permitted" in graphed.failed
