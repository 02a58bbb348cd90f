"""The planner's memory as text is the world's memory-query prompt, byte for byte: one
fact per segment in arrival order, the goal as the query (what `world` was trained on)."""

from __future__ import annotations

import numpy as np

from embodied_kv.kv.memory import MemoryOp, SegmentMemory
from embodied_kv.world.memory import sample_query


def test_segments_and_goal_make_the_memory_query_prompt():
    rng = np.random.default_rng(3)
    for hops in (1, 2):
        mq = sample_query(rng, hops, n_updates=3)
        mem = SegmentMemory()
        for i, fact in enumerate(mq.facts):  # a group per fact: arrival order is kept
            mem.apply(MemoryOp.ADD, f"fact-{i}", fact, max_segments=16, group=f"g{i}")
        assert mem.prompt(mq.query) == mq.prompt
    mem.apply(MemoryOp.REMOVE, "fact-0", "", max_segments=16)
    assert mem.prompt("q ?") == f"\nFacts: {' '.join(mq.facts[1:])}\nQuery: q ?\nAnswer: "
