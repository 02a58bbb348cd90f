"""Real-time chunking in the engine: off is today's path in bytes, beta = 0 through the engine
is too, the guided loop replays from its graph (emulation) as eager in bytes, the queue
measures d and reports the boundary jump, and the guide is the previous chunk shifted to
the new chunk's first tick."""

import dataclasses

import numpy as np
import pytest
import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.rtc_guide import ChunkGuide
from embodied_kv.model.rtc import RTCConfig, prefix_weights
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import denoise_rows

REPLAN = 5


pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


def run_engine(model, rtc: RTCConfig, mode="off", cycles=4, delay=2):
    """Cycles every REPLAN ticks; `delay` ticks popped between a cycle's observation and
    its chunk (the chunk lands `delay` ticks late) -> (chunks' bytes, engine)."""
    cfg = EngineConfig(num_slots=2, control_hz=0.01, narrate_every=0, history=0, blend=0,
                       auto_episode_capsule=False, replan_every=REPLAN, rtc=rtc)  # fmt: skip
    engine = Engine(cfg, model=model, graph_mode=mode)
    engine.observe(synthetic_observation(model.cfg, 0))
    engine.warmup()
    engine.begin_episode()
    captured = engine.graphs.captures if engine.graphs else 0
    chunks = []
    for c in range(cycles):
        t0 = c * REPLAN
        engine.observe(synthetic_observation(model.cfg, c, "stack the cups"))
        if c:
            for k in range(t0, t0 + delay):
                engine.queue.pop(k)
        chunks.append(engine.cycle(t0).chunk.tobytes())
        for k in range(t0 + (delay if c else 0), t0 + REPLAN):
            engine.queue.pop(k)
    if engine.graphs is not None:
        assert engine.graphs.captures == captured  # the guided graphs came from warmup
        model.graphs = None
    return chunks, engine


def test_rtc_off_is_todays_denoise_path_in_bytes(tiny_model):
    """Off (the default): each chunk is ActionExpert.sample's bytes (the plain loop, which
    RTC does not touch), and the queue keeps no model-unit chunk."""
    m = tiny_model
    chunks, engine = run_engine(m, RTCConfig())
    assert engine.loop.rtc is None
    assert set(engine.queue.state_tensors()) == {"last", "chunk"}
    for c, got in enumerate(chunks):
        arena = m.new_arena(1, engine.manager.arena.spec.max_len)
        slot = arena.allocate()
        obs = engine.robot.model_observation(synthetic_observation(m.cfg, c, "stack the cups"))
        m.prefill(arena, slot, m.embed_prefix(obs))
        n = arena.slot_len(slot)
        rows = denoise_rows(n, arena.spec.max_len)
        plain = m.expert.sample(arena, slot, torch.tensor(n), m.make_noise(c), rows)
        want = engine.robot.actions_out(plain.float().numpy(), obs.robot_state)
        assert np.asarray(want, np.float64).tobytes() == got


@pytest.mark.parametrize("guidance", ["vjp", "error"])
def test_beta_zero_through_the_engine_is_plain_in_bytes(tiny_model, guidance):
    plain, _ = run_engine(tiny_model, RTCConfig())
    zero, engine = run_engine(tiny_model, RTCConfig(True, 0.0, guidance=guidance))
    assert zero == plain
    assert engine.loop.rtc.counters.guided == 3  # every chunk after the first was guided
    guided, _ = run_engine(tiny_model, RTCConfig(True, 5.0, guidance=guidance))
    assert guided[0] == plain[0] and guided[1:] != plain[1:]


@pytest.mark.parametrize("guidance", ["vjp", "error", "prefix"])
def test_guided_graph_replay_equals_eager_in_bytes(tiny_model, guidance):
    """Emulated capture of the guided loop (its VJP included), replayed for other prefixes,
    other noise, other previous chunks and other W (d measured 2, then fixed 3)."""
    for delay in ("measured", 3):
        rtc = RTCConfig(True, 5.0, guidance=guidance, delay=delay, schedule="exp")
        eager, _ = run_engine(tiny_model, rtc)
        graphed, engine = run_engine(tiny_model, rtc, mode="emulate")
        assert graphed == eager
        spec = engine.manager.arena.spec
        longest = min(spec.max_len, tiny_model.cfg.prefix_tokens_max)
        rows = sorted({denoise_rows(p, spec.max_len) for p in range(1, longest + 1)})
        want = [(s, r, guidance, 5.0) for s in range(2) for r in rows]  # every row bucket
        assert sorted(engine.graphs._guided) == want
        assert engine.loop.rtc.counters.last_delay == (2 if delay == "measured" else 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("guidance", ["vjp", "error", "prefix"])
def test_guided_cuda_graph_replay_equals_eager_in_bytes(guidance):
    """The guided loop captured by torch.cuda.graph, the VJP inside (the fused kernels fall
    back to their torch references while autograd records, in the graph and eagerly)."""
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model

    m = build_model(get_preset("tiny"), "cuda")
    rtc = RTCConfig(True, 5.0, guidance=guidance)
    eager, _ = run_engine(m, rtc)
    graphed, _ = run_engine(m, rtc, mode="cuda")
    assert graphed == eager


def test_the_measured_delay_errs_long():
    """A longer delay is taken at once, a shorter one approached at delay_ema a chunk (a
    held action too many costs a tick of reaction, one too few an unheld switch)."""
    q = ActionQueue(horizon=8, action_dim=1, delay_ema=0.5)
    chunk = np.zeros((8, 1))
    got = []
    q.push(chunk, 0)
    for tick, d in enumerate((1, 4, 1, 1, 1, 1), start=10):
        q.pop(tick)
        q.push(chunk, tick + 1 - d)  # observed d ticks before the tick it lands at
        got.append(q.delay_ticks())
    assert got == [1, 4, 3, 2, 1, 1]  # 4 -> 2.5 -> 1.75 -> 1.375 -> 1.19 (halves up)


def test_queue_measures_delay_and_the_boundary_jump():
    q = ActionQueue(horizon=4, action_dim=2, delay_ema=0.5)
    first = np.arange(8.0).reshape(4, 2)
    q.push(first, 0, model_chunk=first.astype(np.float32) / 10)
    assert q.delay_ticks() is None  # nothing popped yet: no arrival to measure
    assert q.pop(0)[0].tolist() == [0.0, 1.0] and q.switches.switches == 0
    q.pop(1)
    q.pop(2)
    second = -np.ones((4, 2))
    q.push(second, 1)  # observed at tick 1, lands at tick 3: d = 2
    assert q.delay_ticks() == 2 and q.switches.last_delay == 2
    assert q.previous(5) is None  # pushed without model units
    a, fresh = q.pop(3)
    assert fresh and a.tolist() == [-1.0, -1.0]
    want = float(np.linalg.norm(np.array([-1.0, -1.0]) - first[2]))
    assert q.switches.switches == 1 and q.switches.last_jump == pytest.approx(want)
    q.push(second, 2, model_chunk=np.zeros((4, 3), np.float32))  # lands at 4: d 2 -> EMA 2
    q.pop(4)
    q.push(second, 2, model_chunk=np.ones((4, 3), np.float32))  # lands at 5: d 3, at once
    assert q.delay_ticks() == 3 and q.switches.last_delay == 3
    model, shift = q.previous(5)
    assert shift == 3 and model.shape == (4, 3) and model.dtype == np.float32
    state = q.state_tensors()
    assert set(state) == {"last", "chunk", "model_chunk"}
    other = ActionQueue(4, 2)
    other.check_state(state, q.state_meta())
    other.load_state(state, q.state_meta())
    assert np.array_equal(other.previous(5)[0], model)
    with pytest.raises(ValueError, match="model chunk"):
        q.push(second, 3, model_chunk=np.zeros((3, 3), np.float32))
    q.hold()
    assert q.previous(5) is None


def test_guide_is_the_previous_chunk_shifted_to_the_new_start():
    h, a = 10, 3
    q = ActionQueue(h, a)
    prev = np.arange(h * a, dtype=np.float32).reshape(h, a)
    q.push(prev.astype(np.float64), 100, model_chunk=prev)
    g = ChunkGuide(RTCConfig(True, delay=2, execution_horizon=3), h, 5, "cpu")
    guide = g.guide(q, 104)  # four ticks later: Y = prev[4:], then zeros
    assert torch.equal(guide.target[:6], torch.from_numpy(prev[4:]))
    assert torch.equal(guide.target[6:], torch.zeros(4, a))
    w = prefix_weights(h, 2, 3, "exp")
    w[6:] = 0.0
    assert torch.equal(guide.weights, w) and guide.delay == 2
    assert g.guide(q, 110) is None and g.guide(q, 99) is None  # no overlap / before it
    assert g.counters.chunks == 3 and g.counters.guided == 1 and not g.counters.last_applied
    # a robot of 2 dims on a model of 3: the padding dim (zero in every training chunk,
    # anything in the model's output) is held at 0, the robot's at the old chunk's values
    padded = ChunkGuide(RTCConfig(True, delay=2, execution_horizon=3), h, 5, "cpu", 2)
    target = padded.guide(q, 104).target
    assert torch.equal(target[:6, :2], torch.from_numpy(prev[4:, :2]))
    assert not target[:, 2:].any()
    with pytest.raises(ValueError, match="execution_horizon"):
        ChunkGuide(RTCConfig(True, execution_horizon=11), h, 5, "cpu")
    with pytest.raises(ValueError, match="enabled"):
        ChunkGuide(RTCConfig(), h, 5, "cpu")


def test_engine_config_refuses_rtc_with_action_tokens():
    with pytest.raises(ValueError, match="rtc"):
        EngineConfig(action_mode="ar", rtc=RTCConfig(enabled=True))
    cfg = EngineConfig(rtc=RTCConfig(enabled=True, guidance="error"))
    assert dataclasses.replace(cfg, rtc=RTCConfig()).rtc.enabled is False


def test_rtc_parameters_make_the_engines_rtc_config():
    from embodied_kv.config_file import default_config_path, load_params
    from embodied_kv.engine.params import ENGINE_PARAMS, engine_config

    defaults = {spec.name: spec.default for spec in ENGINE_PARAMS}
    shipped = load_params(default_config_path()).for_node("kv_manager")
    assert engine_config(lambda n: shipped.get(n, defaults[n])).rtc == RTCConfig()
    values = defaults | {"rtc.enabled": True, "rtc.delay": 3, "rtc.guidance": "error",
                         "rtc.max_guidance": 10, "rtc.schedule": "linear"}  # fmt: skip
    rtc = engine_config(values.__getitem__).rtc
    assert rtc == RTCConfig(True, 10.0, 0, "linear", "error", 3)
    for name, bad, complaint in (("rtc.delay", "soon", "must be an integer"),
                                 ("rtc.schedule", "cosine", "rtc.schedule"),
                                 ("rtc.enabled", "yes", "true or false")):  # fmt: skip
        with pytest.raises(ValueError, match=complaint):
            engine_config((values | {name: bad}).__getitem__)


def test_a_new_instruction_starts_a_chunk_no_guide_ties_to_the_old_task(tiny_model):
    """The chunk executing when the instruction changes was planned for the old task: the
    next chunk is sampled free (as an episode's first), the robot keeps executing the old
    chunk until it lands, and guidance resumes with the chunk after."""
    _, engine = run_engine(tiny_model, RTCConfig(enabled=True, guidance="error"), cycles=2)
    counters = engine.loop.rtc.counters
    assert counters.last_applied and counters.guided == 1
    t0 = 2 * REPLAN
    engine.observe(synthetic_observation(tiny_model.cfg, 2, "unstack the cups"))
    assert engine.queue.previous(t0) is None and engine.queue.pop(t0)[1]  # still executing
    engine.cycle(t0)
    assert not counters.last_applied and counters.guided == 1
    engine.observe(synthetic_observation(tiny_model.cfg, 3, "unstack the cups"))
    engine.cycle(t0 + REPLAN)
    assert counters.last_applied and counters.guided == 2


def test_a_chunk_from_a_scene_older_than_its_instruction_is_not_the_plan(tiny_model):
    """An observation whose state was captured before its instruction arrived shows the scene
    before the task was given (a reset robot's first frames): its chunk acts, but the next
    chunk is not guided towards it; the one after is guided again."""
    _, engine = run_engine(tiny_model, RTCConfig(enabled=True, guidance="error"), cycles=2)
    counters = engine.loop.rtc.counters
    t0 = 2 * REPLAN
    stale = synthetic_observation(tiny_model.cfg, 2, "unstack the cups")
    engine.observe(dataclasses.replace(stale, after_instruction=False))
    engine.cycle(t0)
    assert engine.queue.pop(t0)[1] and engine.queue.previous(t0 + REPLAN) is None
    assert counters.stale_observations == 1 and counters.guided == 1
    engine.observe(synthetic_observation(tiny_model.cfg, 3, "unstack the cups"))
    engine.cycle(t0 + REPLAN)  # fresh: free, and the plan from here on
    assert not counters.last_applied and engine.queue.previous(t0 + 2 * REPLAN) is not None
    engine.observe(synthetic_observation(tiny_model.cfg, 4, "unstack the cups"))
    engine.cycle(t0 + 2 * REPLAN)
    assert counters.last_applied and counters.guided == 2


def test_prefix_guidance_holds_the_stale_actions_of_the_chunk_executing(tiny_model):
    """`guidance: prefix` (training-time RTC): each new chunk's first d actions are the
    previous chunk's for the same ticks, in model units and so in robot units, also with
    the exp schedule's band after them guided."""
    rtc = RTCConfig(True, guidance="prefix", delay=2, schedule="exp")
    chunks, engine = run_engine(tiny_model, rtc)
    h, a = tiny_model.cfg.action_horizon, engine.robot.action_dim
    rows = [np.frombuffer(c, dtype=np.float64).reshape(h, a) for c in chunks]
    for old, new in zip(rows, rows[1:], strict=False):
        assert np.array_equal(new[:2], old[REPLAN : REPLAN + 2])
        assert not np.array_equal(new[2:], old[REPLAN + 2 :][: h - 2])  # the rest is new
    guide = engine.loop.rtc
    assert guide.counters.guided == len(chunks) - 1
