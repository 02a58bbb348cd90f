"""The pi05 architecture at its real widths, 2 layers deep, through a whole engine cycle
on the CPU in bf16: prefill of 3 cameras + prompt, 10 Euler steps, batched language
decode, snapshot and restore (bytes), and the cycle after a restore = the cycle it
replaced (bytes and tokens). Only the depth is reduced (18 -> 2, SigLIP 27 -> 1)."""

import pytest
import torch

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.policy import LoopConfig, arena_rows_needed
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.kv.manager import Status
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

LAYERS, VISION_LAYERS = 2, 1
BUDGET = 8  # tokens per narration / answer: > 2 cycles of STEPS (nothing ends before a restore)
STEPS = 3  # decode steps per cycle


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cfg = get_preset("pi05", layers=LAYERS, vision_layers=VISION_LAYERS)
    model = build_model(cfg, "cpu", dtype=torch.bfloat16)
    disk = tmp_path_factory.mktemp("pi05") / "capsules"
    ecfg = EngineConfig(
        preset="pi05",
        control_hz=0.001,  # a period of 1,000 s: STEPS decode steps per cycle, no deadline
        # (0.01 left no decode time when this ran beside a training run: a cycle took > 100 s)
        narrate_every=1,
        narration_tokens=BUDGET,
        answer_tokens=BUDGET,
        max_decode_steps=STEPS,
        history=0,
        store=StoreConfig(disk_dir=str(disk)),
    )
    return Engine(ecfg, model=model)


def test_real_widths_and_an_auto_sized_arena(engine):
    m, c = engine.model, engine.model.cfg
    b, e = m.backbone, m.expert
    assert (c.backbone.width, c.expert.width, c.vision.width) == (2048, 1024, 1152)
    assert (c.backbone.heads, c.backbone.kv_heads, c.backbone.head_dim) == (8, 1, 256)
    assert b.embed_tokens.weight.shape == (257_152, 2048)
    assert b.layers[0].self_attn.k_proj.weight.shape == (256, 2048)
    assert b.layers[0].mlp.gate_proj.weight.shape == (16_384, 2048)
    assert e.layers[0].self_attn.q_proj.weight.shape == (2048, 1024)
    assert e.layers[0].mlp.up_proj.weight.shape == (4096, 1024)
    assert (c.vision.image_size, c.vision.tokens, c.num_cameras) == (224, 256, 3)
    assert m.vision.tower.encoder.layers[0].mlp.fc1.weight.shape == (4304, 1152)
    assert (len(b.layers), len(e.layers)) == (LAYERS, LAYERS)
    rows = arena_rows_needed(c, LoopConfig(narration_tokens=BUDGET, answer_tokens=BUDGET))
    assert engine.manager.arena.spec.max_len == rows >= c.prefix_tokens_max + BUDGET
    assert engine.manager.arena.k.dtype == torch.bfloat16


def slot_bytes(engine) -> dict:
    a = engine.manager.arena
    return {
        s: (a.k[:, s].clone(), a.v[:, s].clone(), a.length[:, s].clone(), int(a.next_pos[s]))
        for s in a.in_use()
    }


# bf16 at pi05's widths on a CPU without bf16 units (this 2-core Zen2): ~210 s idle
# (2026-11-25), past the suite's 300 s under load; a hang still fails at 900 s
@pytest.mark.timeout(900)
def test_whole_cycle_snapshot_and_restore(engine):
    m = engine.model
    velocities = []
    hidden_at = m.expert.hidden_at  # one call per Euler step (the head then runs fused)

    def counted(*args, **kwargs):
        velocities.append(1)
        return hidden_at(*args, **kwargs)

    m.expert.hidden_at = counted
    engine.observe(synthetic_observation(m.cfg, 0, "put the red cup on the plate"))
    engine.begin_episode()
    engine.ask("where is the cup?")
    try:
        first = engine.cycle(0)
    finally:
        del m.expert.hidden_at
    prompt = m.embed_prefix(synthetic_observation(m.cfg, 0, "put the red cup on the plate"))
    assert first.prefix_len == prompt.embeds.shape[0] > 3 * 256
    assert len(velocities) == m.cfg.denoise_steps == 10
    assert first.chunk.shape == (50, 32) and first.chunk.dtype.name == "float64"  # robot units
    assert (abs(first.chunk) < 1e3).all()
    # the answer and the narration decode together: 2 tokens per packed step (plus the
    # narration's first token, from the prefill's logits)
    assert first.decode_steps == STEPS
    assert engine.manager.counters.tokens == 1 + 2 * STEPS

    engine.snapshot("mid", "host")
    before = slot_bytes(engine)
    requests = {r.request_id: list(r.tokens) for r in engine.manager.requests.values()}
    assert len(before) == 2
    second = engine.cycle(5)  # a new frame prefill + more decode over the live slots

    def lengths(state):
        return {s: x[2].tolist() for s, x in state.items()}

    assert lengths(slot_bytes(engine)) != lengths(before)

    engine.restore("mid")
    after = slot_bytes(engine)
    assert after.keys() == before.keys()
    for s, (k, v, length, pos) in before.items():
        k2, v2, length2, pos2 = after[s]
        n = int(length.max())
        assert torch.equal(k[:, :n].view(torch.int16), k2[:, :n].view(torch.int16))
        assert torch.equal(v[:, :n].view(torch.int16), v2[:, :n].view(torch.int16))
        assert torch.equal(length, length2) and pos == pos2
    assert {r.request_id: r.tokens for r in engine.manager.requests.values()} == requests

    again = engine.cycle(5)
    assert again.chunk.tobytes() == second.chunk.tobytes()

    def texts(events):  # ids without the epoch: the replay runs in a new timeline
        return [(e.request_id.split("@")[0], e.text) for e in events
                if e.status is not Status.CANCELLED]  # fmt: skip

    assert texts(again.events) == texts(second.events)
