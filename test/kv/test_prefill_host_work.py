"""The selective prefill's host work grows with layers, not with layers x segments.

Counts, not times: the torch ops one prefill dispatches at 10 and at 40 memory segments
(one block per segment, the most blocks a prompt can have). On the H100 a KEEP prefill
of 40 segments was 0.66 ms of GPU work in 30 ms of wall time: ~276 per-segment
cudaMemcpyAsync, ~767 selects and ~434 slices; every op counted here is a launch or a
host step there.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from embodied_kv.bench.keep_stream import Stream
from embodied_kv.kv.memory import MemoryConfig, MemoryOp, SegmentMemory
from embodied_kv.kv.memory_kv import compute_block, layout
from embodied_kv.kv.memory_methods import methods
from embodied_kv.model.vla import StepInput

SEGMENTS = (10, 40)
SLACK_PER_LAYER = 8  # ops a layer may add at 40 segments: a branch taken, never a loop
WRITES = {"copy_", "index_copy_", "index_put_", "_to_copy"}


class OpCount(TorchDispatchMode):
    """Every dispatched op by name; apart, the ops reading a host-tier block and the
    writes into the arena's K/V."""

    def __init__(self, blocks: set[int], arena: set[int]):
        super().__init__()
        self.blocks, self.arena = blocks, arena
        self.ops: collections.Counter = collections.Counter()
        self.block_reads = 0
        self.kv_writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        ptrs = {storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.block_reads += bool(ptrs & self.blocks)
        self.kv_writes += name in WRITES and storage(args[0]) in self.arena
        return func(*args, **(kwargs or {}))


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def one_prefill(model, segments: int, method_name: str) -> OpCount:
    """A memory of `segments` facts, a block per fact, and one plan request's prefill
    (after a warm-up request) counted."""
    stream = Stream.make(segments, seed=segments)
    memory = SegmentMemory(MemoryConfig(window=10, static_groups=False))
    for key, text, group in stream.segments():
        memory.apply(MemoryOp.ADD, key, text, segments, group)
    arena = model.new_arena(4, 512)
    frame, work, cache = (arena.allocate() for _ in range(3))
    prefix = torch.randn(24, model.cfg.backbone.width, generator=torch.Generator().manual_seed(0))
    model.step(arena, [StepInput(frame, embeds=prefix, causal=False)])
    memory.refresh(lambda texts: compute_block(model, arena, work, texts))
    query, _ = stream.query(2, [t for u in memory.units() for t in u.texts])
    lay = layout(model, memory.units(), memory.blocks, query)
    assert sum(p.block is not None for p in lay.placed) == segments
    method = next(m for m in methods(cache) if m.name == method_name)
    blocks = {storage(b.k) for b in memory.blocks.values()}
    blocks |= {storage(b.v) for b in memory.blocks.values()}
    count = OpCount(blocks, {storage(arena.k), storage(arena.v)})
    for warm in (True, False):
        slot = arena.allocate()
        arena.copy_slot(frame, slot)
        if warm:
            method.prefill(model, arena, slot, lay)
        else:
            with count:
                method.prefill(model, arena, slot, lay)
        arena.release(slot)
    return count


@pytest.mark.parametrize("name", ["keep", "cacheblend", "reuse", "keep-no-balance"])
def test_a_prefill_dispatches_as_many_ops_at_40_segments_as_at_10(world_model, name):
    layers = world_model.cfg.backbone.layers
    few, many = (one_prefill(world_model, n, name) for n in SEGMENTS)
    total = {n: sum(c.ops.values()) for n, c in zip(SEGMENTS, (few, many), strict=True)}
    assert total[40] <= total[10] + SLACK_PER_LAYER * layers, (total, many.ops.most_common(8))
    # the host tier is read once per request (the packed image: one cat per K and V)
    assert few.block_reads == many.block_reads <= 2
    # per layer and K/V one indexed write of the copies (at most two issue points write a
    # layer), one of the layer's own rows: O(layers), whatever the segment count
    assert few.kv_writes == many.kv_writes <= 2 * (2 + 1) * layers
