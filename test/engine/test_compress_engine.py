"""VL-Cache in the engine: `language.kv_budget` 1.0 is the engine without compression (bytes,
tokens, chunks); compressed slots go through capsules byte-exactly, per-layer lengths
included, and a restored run continues token for token."""

import pytest
import torch

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.kv.compress import CompressConfig
from embodied_kv.kv.manager import Status
from embodied_kv.model.synthetic import synthetic_observation


def make_engine(model, compress=None):
    cfg = EngineConfig(control_hz=0.01, narrate_every=1, narration_tokens=10, max_decode_steps=2,
                       history=0, **({"compress": compress} if compress else {}))  # fmt: skip
    return Engine(cfg, model=model)


def run(engine, model, frames, first=0):
    """frames cycles, a question every other one -> (chunk bytes, finished texts by id)."""
    chunks, texts = [], {}
    for i in range(first, first + frames):
        engine.observe(synthetic_observation(model.cfg, i, "stack the red block"))
        if i % 2 == 0:
            engine.ask(f"what is left of block {i} ?")
        res = engine.cycle(5 * i)
        chunks.append(res.chunk.tobytes())
        texts |= {e.request_id.split("@")[0]: e.text for e in res.events
                  if e.done and e.status is not Status.CANCELLED}  # fmt: skip
    return chunks, texts


def slot_state(engine):
    a = engine.manager.arena
    return {s: (a.length[:, s].tolist(), int(a.next_pos[s]),
                [a.k[i, s, : int(a.length[i, s])].clone() for i in range(a.spec.num_layers)],
                [a.v[i, s, : int(a.length[i, s])].clone() for i in range(a.spec.num_layers)])
            for s in a.in_use()}  # fmt: skip


def test_budget_one_is_the_engine_without_compression(tiny_model):
    runs = []
    for compress in (None, CompressConfig(budget=1.0, method="h2o", window=3)):
        e = make_engine(tiny_model, compress)
        e.begin_episode()
        runs.append((run(e, tiny_model, 4), e.manager.arena.k.clone(), e.manager.arena.length))
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


def test_capsule_restores_compressed_slots_byte_exactly(tiny_model):
    e = make_engine(tiny_model, CompressConfig(budget=0.2))
    e.begin_episode()
    run(e, tiny_model, 3)
    live = slot_state(e)
    lengths = [v[0] for v in live.values()]
    assert any(len(set(ls)) > 1 for ls in lengths), lengths  # per-layer lengths differ
    e.snapshot("mid")
    ref = make_engine(tiny_model, CompressConfig(budget=0.2))  # never interrupted
    ref.begin_episode()
    run(ref, tiny_model, 3)
    ref_chunks, ref_texts = run(ref, tiny_model, 4, first=3)
    ref_texts |= {ev.request_id.split("@")[0]: ev.text for ev in ref.loop.finish_all()}

    # nothing ends between the snapshot and the restore: every request goes on (a request
    # that had ended would not come back, docs/requests.md)
    e.manager.arena.k.normal_()
    e.manager.arena.v.normal_()
    e.manager.arena.length.random_(0, 50)
    e.restore("mid")
    back = slot_state(e)
    assert back.keys() == live.keys()
    for s, (ls, pos, ks, vs) in live.items():
        assert back[s][0] == ls and back[s][1] == pos
        assert all(torch.equal(a, b) for a, b in zip(ks + vs, back[s][2] + back[s][3], strict=True))
    chunks, texts = run(e, tiny_model, 4, first=3)
    texts |= {ev.request_id.split("@")[0]: ev.text for ev in e.loop.finish_all()}
    assert chunks == ref_chunks and texts == ref_texts and len(texts) >= 4


def test_graph_replay_over_compressed_slots_equals_eager(tiny_model):
    """CUDA-graph code in CPU emulation: decode steps replay over compressed slots (per-layer
    kv_len read from the plan's device buffers); the recorded prefill and the compressed
    expert run eagerly. Chunks and texts equal the eager engine's."""
    outs = []
    for mode in ("off", "emulate"):
        for expert in (False, True):
            compress = CompressConfig(budget=0.1, compress_expert=expert)
            cfg = EngineConfig(num_slots=3, control_hz=0.01, narrate_every=1, narration_tokens=8,
                               max_decode_steps=3, history=0, compress=compress)  # fmt: skip
            e = Engine(cfg, model=tiny_model, graph_mode=mode)
            try:
                e.observe(synthetic_observation(tiny_model.cfg, 0, "stack the red block"))
                e.warmup()
                e.begin_episode()
                outs.append((mode, expert, run(e, tiny_model, 4)))
                if mode == "emulate":
                    assert e.graphs.captures > 0
            finally:
                tiny_model.graphs = None
    by = {(m, x): r for m, x, r in outs}
    assert by[("emulate", False)] == by[("off", False)]
    assert by[("emulate", True)] == by[("off", True)]
    assert by[("off", True)][0] != by[("off", False)][0]  # the expert read fewer rows


def test_compression_with_action_tokens_is_refused_with_the_reason():
    """`ar` mode prefills inside ActionFlow's packed step (no statistics): a budget below 1
    there fails the config with what to change, instead of being silently ignored."""
    with pytest.raises(ValueError, match="action_mode 'flow' only"):
        EngineConfig(action_mode="ar", compress=CompressConfig(budget=0.1))
    assert not EngineConfig(action_mode="ar", compress=CompressConfig(budget=1.0)).compress.enabled
