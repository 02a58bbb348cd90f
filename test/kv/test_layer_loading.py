"""The layer-balanced copy schedule (which copies precede which layer) and its CPU run."""

import random

import pytest
import torch

from embodied_kv.kv.layer_loading import Copy, LayerLoader, LoadSchedule, Source
from embodied_kv.kv.memory import KVBlock
from embodied_kv.kv.memory_kv import rerotate


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
