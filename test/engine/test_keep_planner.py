"""The engine's planner memory as KV (KEEP) in the control loop: the same plan as full
recomputation when KEEP recomputes everything, and the memory (segments, groups, host-tier
blocks) inside the session's capsules."""

import pytest
import torch

from embodied_kv.engine.engine import EPISODE_START, Engine, EngineConfig
from embodied_kv.kv.compress import CompressConfig
from embodied_kv.kv.manager import Status
from embodied_kv.kv.memory import MemoryConfig, MemoryOp
from embodied_kv.kv.selectors import KeepConfig
from embodied_kv.model.synthetic import synthetic_observation

FACTS = [
    ("red", "the red box is on the shelf ."),
    ("key", "the blue key is in the red box ."),
    ("red2", "the red box is open ."),
    ("bowl", "the green bowl is on the table ."),
]


def make_engine(model, mode="keep", **kw):
    """KEEP at any memory size (keep_min_segments 0) unless a test says otherwise."""
    kw = {"keep_min_segments": 0, **kw}
    cfg = EngineConfig(control_hz=0.001, answer_tokens=6, history=0, request_tokens=256,
                       memory_mode=mode, memory=MemoryConfig(window=3), **kw)  # fmt: skip
    engine = Engine(cfg, model=model)
    engine.begin_episode()
    for key, text in FACTS:
        engine.update_memory(MemoryOp.ADD, key, text, 16, group=text.split()[2])
    return engine


def plan(engine, goal="where is the blue key ?"):
    """One plan request through the control loop -> its final event."""
    request_id, refused = engine.plan(goal)
    assert refused is None
    for _ in range(6):
        engine.observe(synthetic_observation(engine.model.cfg, 0, "tidy up"))
        for ev in engine.cycle(5 * engine.frame).events:
            if ev.request_id == request_id and ev.done:
                return ev
    raise AssertionError("the plan did not finish")


def test_keep_recomputing_everything_plans_the_same_tokens_as_full(tiny_model):
    full = make_engine(tiny_model, "full")
    layers = tiny_model.cfg.backbone.layers
    everything = make_engine(tiny_model, keep=KeepConfig(ratios=(1.0,) * layers))  # the config
    a, b = plan(full), plan(everything)
    assert a.status is b.status is Status.OK and a.text == b.text
    assert everything.planner.fallbacks == 0 and everything.memory.blocks  # read as KV
    active = everything.planner.method.stats.active
    assert active == [active[0]] * layers  # every token at every layer: the ratios arrived


def test_a_memory_under_keep_min_segments_is_prefilled_whole(tiny_model):
    """The default engine config: four facts are under keep_min_segments (16), so a plan
    reads them as text, as `full` does (the same tokens, no block computed); from the
    threshold on KEEP reads them as cached KV."""
    assert EngineConfig().keep_min_segments == 16 and len(FACTS) < 16
    full = make_engine(tiny_model, "full")
    small = make_engine(tiny_model, keep_min_segments=16)
    a, b = plan(full), plan(small)
    assert a.status is b.status is Status.OK and a.text == b.text
    assert small.planner.small == 1 and small.planner.fallbacks == 0
    assert not small.memory.blocks and small.memory.counters.computed_segments == 0
    at = make_engine(tiny_model, keep_min_segments=len(FACTS))
    assert plan(at).status is Status.OK
    assert at.planner.small == 0 and at.memory.blocks  # KEEP: the facts as cached KV
    with pytest.raises(ValueError, match="keep_min_segments"):
        EngineConfig(keep_min_segments=-1)


def test_default_keep_plans_from_cached_blocks_after_updates(tiny_model):
    engine = make_engine(tiny_model)
    assert plan(engine).status is Status.OK
    made = engine.memory.counters.computed_segments
    assert made == len(FACTS)
    engine.update_memory(MemoryOp.UPDATE, "bowl", "the green bowl is on the sink .", 16)
    assert plan(engine).status is Status.OK
    assert engine.memory.counters.computed_segments == made + 1  # only the updated one
    assert engine.planner.fallbacks == 0


def test_memory_and_its_kv_are_session_state(tiny_model):
    engine = make_engine(tiny_model)
    for i in range(3):  # group "box" reaches the window: a joint block next plan
        engine.update_memory(MemoryOp.UPDATE, "bowl", f"the green bowl is on the {i} .", 16)
    plan(engine)
    assert "group:box" in engine.memory.blocks
    meta = engine.memory.state_meta()
    saved = {k: (b.k.clone(), b.v.clone()) for k, b in engine.memory.blocks.items()}
    engine.snapshot("planned", "host")
    engine.update_memory(MemoryOp.UPDATE, "key", "the blue key is in the green bowl .", 16)
    engine.update_memory(MemoryOp.REMOVE, "red2", "", 16)
    plan(engine)
    assert engine.memory.state_meta() != meta
    engine.restore("planned")
    assert engine.memory.state_meta() == meta
    assert set(engine.memory.blocks) == set(saved)
    for key, (k, v) in saved.items():
        assert torch.equal(engine.memory.blocks[key].k, k)
        assert torch.equal(engine.memory.blocks[key].v, v)
    engine.reset(EPISODE_START)
    assert len(engine.memory) == 0 and not engine.memory.blocks and engine.memory.clock == 0


def test_a_plan_whose_memory_changed_before_admission_is_prefilled_as_text(tiny_model):
    engine = make_engine(tiny_model)
    request_id, _ = engine.plan("where is the red box ?")
    engine.update_memory(MemoryOp.UPDATE, "red", "the red box is on the sink .", 16)
    engine.observe(synthetic_observation(engine.model.cfg, 0, "tidy up"))
    done = {e.request_id: e for e in engine.cycle(0).events if e.done}
    assert engine.planner.fallbacks == 1 and done[request_id].status is Status.OK
    assert not engine.memory.blocks  # nothing computed for a prompt that is not the memory's


def test_keep_graphs_in_the_engine_plan_what_eager_keep_plans(tiny_model):
    """`memory.keep_graphs`: the planner's KEEP prefill replayed from graphs (CPU
    emulation of the engine's GraphRunner) over a memory that changes between plans."""
    texts = []
    for mode, graphs in (("off", False), ("emulate", True)):
        cfg = EngineConfig(control_hz=0.001, answer_tokens=6, history=0, request_tokens=256,
                           memory=MemoryConfig(window=3), keep_graphs=graphs,
                           memory_mode="keep", keep_min_segments=0)  # fmt: skip
        engine = Engine(cfg, model=tiny_model, graph_mode=mode)
        try:
            engine.begin_episode()
            for key, text in FACTS:
                engine.update_memory(MemoryOp.ADD, key, text, 16, group=text.split()[2])
            out = [plan(engine).text]
            engine.update_memory(MemoryOp.UPDATE, "bowl", "the green bowl is on the sink .", 16)
            out.append(plan(engine, "where is the green bowl ?").text)
            engine.update_memory(MemoryOp.ADD, "cup", "the red cup is in the green bowl .", 16)
            out.append(plan(engine, "where is the red cup ?").text)  # the memory grew
            texts.append(out)
            assert engine.planner.fallbacks == 0
            assert (getattr(engine.planner.method, "graphs", None) is not None) == graphs
            if graphs:  # one KEEP graph served the three plans: it has room to grow
                assert engine.planner.method.runner.replays >= 3
                assert len(engine.planner.method.graphs) == 1
        finally:
            tiny_model.graphs = None
    assert texts[0] == texts[1]


@pytest.mark.parametrize("ratios", ["all", "default"])
def test_a_plan_over_a_compressed_prefix_reads_the_memory_as_kv(tiny_model, ratios):
    """VL-Cache leaves the frame's slot with a row count per layer; KEEP places each
    layer's cached rows at that layer's own offset, so the plan still reads its memory
    as KV (no fallback). Recomputing everything it plans full's tokens over the same
    compressed prefix; the prefix rows stay as they were."""
    layers = tiny_model.cfg.backbone.layers
    cfg = KeepConfig(ratios=(1.0,) * layers) if ratios == "all" else KeepConfig()
    full = make_engine(tiny_model, "full", compress=CompressConfig(budget=0.3))
    engine = make_engine(tiny_model, keep=cfg, compress=CompressConfig(budget=0.3))
    seen = []
    method = engine.planner.method
    prefill = method.prefill

    def spy(model, arena, slot, lay, frame=0):
        lengths = arena.length[:, slot].clone()
        prefix = [arena.k[i, slot, : int(n)].clone() for i, n in enumerate(lengths)]
        out = prefill(model, arena, slot, lay, frame)
        kept = all(torch.equal(arena.k[i, slot, : len(p)], p) for i, p in enumerate(prefix))
        seen.append((lengths.tolist(), kept))
        return out

    method.prefill = spy
    a, b = plan(full), plan(engine)
    assert a.status is b.status is Status.OK
    assert engine.planner.fallbacks == 0 and len(seen) == 1
    lengths, kept = seen[0]
    assert len(set(lengths)) > 1 and kept  # it was compressed; the prefix untouched
    if ratios == "all":
        assert a.text == b.text


def test_a_failed_plan_prefill_restores_the_compressed_frame_slot(tiny_model, monkeypatch):
    """The adopted frame slot gets its per-layer row counts back when KEEP's prefill over
    it fails (a truncation to the uncompressed prefix length would refuse them)."""
    engine = make_engine(tiny_model, compress=CompressConfig(budget=0.3))
    seen = []

    def boom(model, arena, slot, lay, frame=0):
        seen.append((slot, arena.length[:, slot].clone(), arena.next_pos[slot].clone()))
        arena.length[:, slot] += 5  # a prefill that wrote rows, then failed
        arena.next_pos[slot] += 5
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.planner.method, "prefill", boom)
    with pytest.raises(RuntimeError, match="device fault"):
        plan(engine)
    slot, lengths, pos = seen[0]
    arena = engine.manager.arena
    assert len(set(lengths.tolist())) > 1  # compressed before the prefill
    assert torch.equal(arena.length[:, slot], lengths) and arena.next_pos[slot] == pos
