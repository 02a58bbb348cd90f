"""The layer-balanced copy schedule (which copies precede which layer) and its CPU run."""

import random

import pytest
import torch

from embodied_kv.kv.layer_loading import Copy, LayerLoader, LoadSchedule, Source
from embodied_kv.kv.memory import KVBlock
from embodied_kv.kv.memory_kv import rerotate

from .conftest import PerSegmentLoader


def drive(schedule: LoadSchedule, active: list[set[int]]) -> list[list[Copy]]:
    return [schedule.issue(i, a) for i, a in enumerate(active)]


def shrinking(rng: random.Random, units: int, layers: int, first: set[int]) -> list[set[int]]:
    out = [first]
    for _ in range(layers - 1):
        prev = sorted(out[-1])
        out.append(set(rng.sample(prev, rng.randint(0, len(prev)))))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_every_needed_copy_precedes_its_layer_once_and_points_stay_balanced(seed):
    rng = random.Random(seed)
    units, layers = rng.randint(1, 12), rng.randint(2, 8)
    rows = [rng.randint(1, 9) for _ in range(units)]
    first = set(range(units)) if rng.random() < 0.7 else set()  # KEEP vs full reuse
    active = shrinking(rng, units, layers, first)
    schedule = LoadSchedule(layers, rows)
    points = drive(schedule, active)
    issued = {}
    for point, copies in enumerate(points):
        for c in copies:
            assert (c.layer, c.unit) not in issued  # at most once
            issued[(c.layer, c.unit)] = point
            assert c.layer >= point  # issued before (or right before) that layer computes
            assert c.layer <= point + 1 or c.unit not in active[point]  # preload: dropped only
    for layer, act in enumerate(active):
        for u in range(units):
            if u not in act:  # the cache is read at this layer: copied by then
                assert issued[(layer, u)] <= layer
    assert all((0, u) not in issued for u in first)  # computed at layer 0: never copied
    mandatory = [sum(rows[c.unit] for c in copies if c.layer <= p + 1) for p, copies in
                 enumerate(points)]  # fmt: skip
    for p, copies in enumerate(points):
        assert sum(rows[c.unit] for c in copies) <= max(mandatory[p], schedule.budget)


def test_dropped_segments_fill_idle_copy_time_with_deeper_layers():
    # 4 segments of 5 rows, 6 layers; after layer 1 only segment 0 stays
    schedule = LoadSchedule(6, [5, 5, 5, 5])
    points = drive(schedule, [{0, 1, 2, 3}, {0}, {0}, {0}, set(), set()])
    assert [(c.layer, c.unit) for c in points[0]] == [(1, u) for u in range(4)]
    # layer 1 of all was copied at point 0; layer 2 of all fills the 20-row budget
    assert [(c.layer, c.unit) for c in points[1]] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    deeper = [(c.layer, c.unit) for c in points[2]]
    assert deeper[:4] == [(3, 0), (3, 1), (3, 2), (3, 3)] and set(deeper[4:]) <= {
        (4, 1), (4, 2), (4, 3), (5, 1), (5, 2), (5, 3)}  # fmt: skip


def test_without_overlap_everything_is_copied_before_layer_0():
    schedule = LoadSchedule(3, [2, 3], overlap=False)
    points = drive(schedule, [{0, 1}, {0}, set()])
    assert [(c.layer, c.unit) for c in points[0]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert points[1] == points[2] == []


def test_issue_out_of_order_is_refused():
    with pytest.raises(ValueError, match="out of order"):
        LoadSchedule(3, [1]).issue(1, set())
    with pytest.raises(ValueError, match="bad schedule"):
        LoadSchedule(0, [1])


def test_the_cpu_loader_places_rerotated_rows(world_model):
    arena = world_model.new_arena(1, 64)
    slot = arena.allocate()
    L, hkv, d = arena.spec.num_layers, arena.spec.kv_heads, arena.spec.head_dim
    g = torch.Generator().manual_seed(1)
    block = KVBlock(torch.randn(L, 6, hkv, d, generator=g), torch.randn(L, 6, hkv, d, generator=g),
                    3, ((0, 2), (2, 4)))  # fmt: skip
    sources = [Source(block, 0, 10, 2, 7), Source(block, 2, 12, 4, 7)]
    loader = LayerLoader(arena, slot, world_model.backbone.rope, sources, LoadSchedule(L, [2, 4]))
    for i in range(L):
        loader.issue(i, {0} if i < 2 else set())
        loader.wait(i)
    rope = world_model.backbone.rope
    for i in range(L):
        want = [u for u in (0, 1) if not (i < 2 and u == 0)]  # unit 0 computed at layers 0, 1
        for u in want:
            s = sources[u]
            rows = slice(s.slot_row, s.slot_row + s.n)
            src = block.k[i, s.block_row : s.block_row + s.n]
            assert torch.equal(arena.k[i, slot, rows], rerotate(rope, src, torch.full((s.n,), 7)))
            assert torch.equal(arena.v[i, slot, rows], block.v[i, s.block_row : s.block_row + s.n])


@pytest.mark.parametrize("seed", range(16))
def test_the_packed_loader_writes_the_bytes_of_per_segment_copies(world_model, seed):
    """Blocks of one to three segments (some placed from their second segment on), gaps
    (units without a block), deltas of both signs, shrinking active sets, with and
    without overlap or preloads: after every layer's wait the slot holds exactly what the
    per-segment copies of the reference loader (conftest.py) put in another slot."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    spec = world_model.new_arena(1, 64).spec
    L, hkv, d = spec.num_layers, spec.kv_heads, spec.head_dim
    sources, row = [], 3
    for _ in range(rng.randint(1, 4)):
        spans = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        kv = [torch.randn(L, sum(spans), hkv, d, generator=g) for _ in range(2)]
        block = KVBlock(*kv, rng.randint(0, 20), tuple(zip(
            [sum(spans[:j]) for j in range(len(spans))], spans, strict=True)))  # fmt: skip
        row += rng.randint(0, 3)  # a unit without a block (or the header) before it
        skip = rng.random() < 0.3 and len(spans) > 1
        for brow, n in block.spans[skip:]:
            sources.append(Source(block, brow, row, n, rng.randint(-30, 30)))
            row += n
    units = range(len(sources))
    first = rng.choice([set(units), set(), set(rng.sample(units, len(units) // 2))])
    budget = rng.choice([0, 3 * sum(s.n for s in sources)])  # large: preloads dropped units
    # seeds 8-15: each layer's slot holds its own row count (a VL-Cache-compressed prefix)
    shift = [0] + [rng.randint(-3, 9) for _ in range(L - 1)] if seed >= 8 else None
    same_as_per_segment(world_model, sources, shrinking(rng, len(sources), L, first), budget,
                        overlap=rng.random() < 0.7, stage=seed % 2 == 1, shift=shift)  # fmt: skip


def test_scattered_units_of_one_layer_are_one_copy_of_their_range(world_model):
    """Preloads of dropped units 1 and 3 (0 and 2 still computed): one layer's copy
    reads rows of units 0..3 of the image and writes those of 1 and 3 alone."""
    spec = world_model.new_arena(1, 64).spec
    L, hkv, d = spec.num_layers, spec.kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(3)
    block = KVBlock(torch.randn(L, 8, hkv, d, generator=g), torch.randn(L, 8, hkv, d, generator=g),
                    2, ((0, 2), (2, 2), (4, 2), (6, 2)))  # fmt: skip
    sources = [Source(block, 2 * u, 4 + 2 * u, 2, 5 - 3 * u) for u in range(4)]
    active = [{0, 1, 2, 3}, {0, 2}] + [set()] * (L - 2)
    copies = same_as_per_segment(world_model, sources, active, budget=100, overlap=True)
    assert {(c.layer, c.unit) for c in copies[1]} >= {(3, 1), (3, 3)}
    assert (3, 0) not in {(c.layer, c.unit) for c in copies[1]}


def same_as_per_segment(model, sources, active, budget, overlap, stage=None,
                        shift=None) -> list[list[Copy]]:  # fmt: skip
    """`stage`: the CUDA path's staging copies, run on the CPU (odd seeds); `shift`: rows
    past the sources' slot rows per layer (the reference places them by hand)."""
    arena = model.new_arena(2, 128)
    a, b = arena.allocate(), arena.allocate()
    L, rope, rows = arena.spec.num_layers, model.backbone.rope, [s.n for s in sources]
    packed = LayerLoader(arena, a, rope, sources, LoadSchedule(L, rows, budget, overlap),
                         stage=stage, shift=shift)  # fmt: skip
    assert (packed.staging is not None) == bool(stage)
    ref = PerSegmentLoader(arena, b, rope, sources, LoadSchedule(L, rows, budget, overlap),
                           shift=shift)  # fmt: skip
    for i in range(L):
        packed.issue(i, active[i])
        ref.issue(i, active[i])
        assert torch.equal(arena.v[:, a], arena.v[:, b])  # no row of an unscheduled copy
        packed.wait(i)
        ref.wait(i)  # keys re-rotated: ref's at the wait, the packed loader's as they land
        assert torch.equal(arena.k[i, a], arena.k[i, b])
    assert torch.equal(arena.k[:, a], arena.k[:, b]) and torch.equal(arena.v[:, a], arena.v[:, b])
    assert packed.schedule.points == ref.schedule.points
    return packed.schedule.points


def test_a_shift_per_layer_is_required_for_every_layer(world_model):
    arena = world_model.new_arena(1, 64)
    L = arena.spec.num_layers
    with pytest.raises(ValueError, match="shifts"):
        LayerLoader(arena, 0, world_model.backbone.rope, [], LoadSchedule(L, [1]), shift=[0])
