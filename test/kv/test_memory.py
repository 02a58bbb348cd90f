"""kv/memory.py: segments by id, groups, static / dynamic blocks, retrieval, capsule state."""

import pytest
import torch

from embodied_kv.kv.memory import MemoryConfig, MemoryOp, SegmentMemory
from embodied_kv.kv.memory_kv import compute_block

ADD, UPDATE, REMOVE = MemoryOp.ADD, MemoryOp.UPDATE, MemoryOp.REMOVE


class Computer:
    """The real block computation over the model, counting the units it computes."""

    def __init__(self, model):
        self.model = model
        self.arena = model.new_arena(2, 128)
        self.work = self.arena.allocate()
        self.calls: list[list[str]] = []

    def __call__(self, texts):
        self.calls.append(list(texts))
        return compute_block(self.model, self.arena, self.work, texts)


def grouped(window=10) -> SegmentMemory:
    mem = SegmentMemory(MemoryConfig(window=window))
    for i, text in enumerate(["the red box is on the shelf .", "the red box is open .",
                              "the blue key is in the red box ."]):  # fmt: skip
        mem.apply(ADD, f"a{i}", text, 64, group="a")
    mem.apply(ADD, "b0", "the green bowl is on the table .", 64, group="b")
    return mem


@pytest.mark.parametrize(
    "op,key,text,words",
    [(9, "x", "t", "unknown operation 9"), (ADD, "a0", "t", "exists"),
     (UPDATE, "zz", "t", "unknown segment"), (REMOVE, "zz", "", "unknown segment"),
     (ADD, "", "t", "without a segment_id"), (UPDATE, "a0", "", "empty text")],
)  # fmt: skip
def test_bad_updates_are_refused_and_change_nothing(op, key, text, words):
    mem = grouped()
    before = mem.state_meta()
    with pytest.raises(ValueError, match=words):
        mem.apply(op, key, text, 64)
    assert mem.state_meta() == before
    with pytest.raises(ValueError, match="memory is full"):
        mem.apply(ADD, "new", "t", max_segments=4)
    assert mem.state_meta() == before


def test_an_update_in_a_dynamic_group_invalidates_only_its_segment(world_model):
    mem, compute = grouped(), Computer(world_model)
    assert mem.refresh(compute) == 4 and not mem.is_static("a")
    blocks = dict(mem.blocks)
    mem.apply(UPDATE, "a1", "the red box is closed .", 64)
    assert set(blocks) - set(mem.blocks) == {"seg:a1"}
    assert all(mem.blocks[k] is blocks[k] for k in mem.blocks)  # the others untouched
    assert mem.refresh(compute) == 1 and compute.calls[-1] == ["the red box is closed ."]
    assert mem.counters.computed_segments == 5 and mem.counters.to_dynamic == 0


def test_a_static_group_is_joint_and_an_update_makes_it_dynamic_once(world_model):
    mem, compute = grouped(window=3), Computer(world_model)
    for i in range(3):  # three updates elsewhere: group a reaches the window
        mem.apply(UPDATE, "b0", f"the green bowl is on the {['sink', 'floor', 'shelf'][i]} .", 64)
    assert mem.is_static("a") and not mem.is_static("b")
    assert [u.key for u in mem.units()] == ["group:a", "seg:b0"]
    mem.refresh(compute)
    assert mem.counters.computed_groups == 1 and mem.counters.to_static == 1
    assert mem.blocks["group:a"].rows == sum(n for _, n in mem.blocks["group:a"].spans)
    mem.apply(UPDATE, "a2", "the blue key is in the green bowl .", 64)
    assert mem.counters.to_dynamic == 1 and "group:a" not in mem.blocks
    assert [u.key for u in mem.units()][:3] == ["seg:a0", "seg:a1", "seg:a2"]
    n = len(compute.calls)
    assert mem.refresh(compute) == 3  # the group recomputed once, segment by segment
    texts = [t for u in mem.units()[:3] for t in u.texts]
    assert sorted(compute.calls[n:]) == sorted([t] for t in texts)
    assert mem.refresh(compute) == 0


def test_retrieval_takes_static_groups_whole_and_dynamic_segments_alone():
    mem = grouped(window=1)
    mem.apply(UPDATE, "b0", "the green bowl is on the sink .", 64)
    assert [u.key for u in mem.units(["a1"])] == ["group:a"]
    assert [u.key for u in mem.units(["b0"])] == ["seg:b0"]
    with pytest.raises(ValueError, match="unknown segments"):
        mem.units(["nope"])


def test_prompt_lists_groups_in_order_in_the_trained_format():
    mem = grouped()
    mem.apply(ADD, "a3", "the red box is closed .", 64, group="a")  # joins a, before b
    assert mem.prompt("where is the blue key ?") == (
        "\nFacts: the red box is on the shelf . the red box is open . the blue key is in the "
        "red box . the red box is closed . the green bowl is on the table .\n"
        "Query: where is the blue key ?\nAnswer: "
    )


def test_grouping_by_the_backbones_mean_pooled_embeddings(world_model):
    emb = world_model.backbone.embed_tokens

    def embed(text):
        ids = torch.tensor(world_model.tokenizer.encode(text, bos=False))
        return emb(ids).mean(0).detach()

    loose = SegmentMemory(MemoryConfig(group_threshold=-1.0), embed=embed)
    strict = SegmentMemory(MemoryConfig(group_threshold=0.999), embed=embed)
    texts = ["the red box is on the shelf .", "the yellow ball is in the blue bowl ."]
    for mem in (loose, strict):
        for i, t in enumerate(texts):
            mem.apply(ADD, f"s{i}", t, 64)
    assert list(loose.groups) == ["auto-1"] and list(strict.groups) == ["auto-1", "auto-2"]
    strict.apply(ADD, "s2", texts[0], 64)  # the same text: cosine 1 (to rounding)
    assert strict.segments["s2"].group == "auto-1"
    strict.apply(ADD, "s3", "the green key is open .", 64, group="mine")  # explicit wins
    assert strict.segments["s3"].group == "mine"
    strict.apply(UPDATE, "s0", "the red box is on the sink .", 64, group="mine")  # moves
    assert strict.groups["mine"].members == ["s3", "s0"]


def test_state_round_trips_exactly_and_bad_state_is_refused(world_model):
    mem, compute = grouped(window=2), Computer(world_model)
    mem.apply(UPDATE, "b0", "the green bowl is on the sink .", 64)
    mem.apply(UPDATE, "b0", "the green bowl is on the floor .", 64)
    mem.refresh(compute)
    tensors, meta = mem.state_tensors(), mem.state_meta()
    other = SegmentMemory(MemoryConfig(window=2))
    other.check_state(tensors, meta)
    other.load_state(tensors, meta)
    assert other.state_meta() == meta and other.prompt("q") == mem.prompt("q")
    for key, block in mem.blocks.items():
        mine = other.blocks[key]
        assert torch.equal(mine.k, block.k) and torch.equal(mine.v, block.v)
        assert other.blocks[key].k is not block.k  # a private copy: the capsule stays immutable
    bad = dict(tensors)
    bad["kv0.k"] = bad["kv0.k"][:, :1]
    with pytest.raises(ValueError, match="memory section"):
        other.check_state(bad, meta)
    mem.clear()
    assert len(mem) == 0 and not mem.blocks and mem.clock == 0
