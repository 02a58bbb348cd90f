"""Where memory blocks live (issue #38): on the arena's device within the memory's
`device_bytes`, in the host tier (pinned) beyond it, and a plan gives the same bytes
either way. The tier only differs on CUDA (on a CPU both are host memory)."""

import tempfile
from pathlib import Path

import pytest
import torch

from embodied_kv.kv import recompute
from embodied_kv.kv.memory import MemoryConfig, MemoryOp, SegmentMemory
from embodied_kv.kv.memory_methods import methods
from embodied_kv.model.trained import TOKENIZER_FILE, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer

from .conftest import PerSegmentLoader
from .test_recompute import Rig, flat


def test_device_bytes_must_not_be_negative():
    with pytest.raises(ValueError, match="device_bytes=-1"):
        MemoryConfig(device_bytes=-1)


def test_on_the_cpu_blocks_stay_where_they_were_computed(world_model):
    rig = Rig(world_model)
    assert rig.memory.blocks and all(b.k.device.type == "cpu" for b in rig.memory.blocks.values())
    summary = rig.memory.summary()
    assert summary["device_bytes"] == 0 and summary["host_bytes"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tiers differ on CUDA only")
@pytest.mark.parametrize("name", ["keep", "cacheblend", "reuse"])
def test_on_cuda_device_and_host_tier_blocks_give_the_reference_bytes(monkeypatch, name):
    """Blocks within the budget stay on the GPU (the image on the device, no staging);
    with no budget every block goes to the pinned host tier (staged copies); a budget
    of one block mixes the two. Each against the per-segment reference loader."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
        model = build_model(world_config(), "cuda", tokenizer_path=str(tok))
    for budget in (256 << 20, 0, 1):
        rig = Rig(model)
        rig.memory = SegmentMemory(MemoryConfig(window=2, device_bytes=budget))
        src = Rig(model).memory  # the same segments and groups, blocks computed anew
        for key, seg in src.segments.items():
            rig.memory.apply(MemoryOp.ADD, key, seg.text, 64, group=seg.group)
        rig.refresh()
        tiers = {b.k.device.type for b in rig.memory.blocks.values()}
        if budget == 0:
            assert tiers == {"cpu"}
            assert all(b.k.is_pinned() for b in rig.memory.blocks.values())
        elif budget > 1:
            assert tiers == {"cuda"} and rig.memory.summary()["host_bytes"] == 0
        method = next(m for m in methods(rig.cache) if m.name == name)
        got = flat(rig.run(method))
        with monkeypatch.context() as m:
            m.setattr(recompute, "LayerLoader", PerSegmentLoader)
            want = flat(rig.run(next(x for x in methods(rig.cache) if x.name == name)))
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x, y), budget


def test_a_block_computed_from_the_step_graphs_has_the_eager_bytes(world_model):
    """compute_block through a GraphRunner (here its CPU emulation: the capture and
    replay code the GPU runs) writes the bytes of the eager step, in one replay."""
    from embodied_kv.engine.graphs import GraphRunner
    from embodied_kv.kv.memory_kv import compute_block

    arena = world_model.new_arena(3, 256)
    work = arena.allocate()
    runner = GraphRunner(world_model, arena, "emulate")
    texts = ["the red box is on the shelf .", "the blue key is in the red box ."]
    eager = compute_block(world_model, arena, work, texts)
    graphed = compute_block(world_model, arena, work, texts, runner)
    assert runner.replays == 1 and arena.slot_len(work) == 0
    assert torch.equal(graphed.k, eager.k) and torch.equal(graphed.v, eager.v)
    assert (graphed.pos0, graphed.spans) == (eager.pos0, eager.spans)
    other = world_model.new_arena(2, 256)  # a runner over another arena is not used
    compute_block(world_model, other, other.allocate(), texts, runner)
    assert runner.replays == 1
