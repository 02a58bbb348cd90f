"""ActionFlow's claims as tests: pipelined = sequential = naive pipe, id for id, for every
frame; the ring never leaks; a capsule taken mid-run resumes token-exactly; language
requests in the same packed step decode what they decode in separate steps."""

import numpy as np
import pytest
import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.ar_loop import ARLoop
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.pipeline import SCHEDULERS, ActionFlow
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import KVCacheManager, Status
from embodied_kv.model.action_space import RobotIO
from embodied_kv.model.action_tokens import (
    ActionTokenConfig,
    action_model_config,
    make_action_tokenizer,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

FRAMES = 50
TOKENS = {
    "bins": ActionTokenConfig("bins", horizon=1),  # K = 8 (tiny: 8 action dims)
    # 4 x 8 symbols: random-weight greedy ids spell them in 7..12 tokens, so frames leave
    # the pipeline both when complete and at the cap K = 12
    "fast": ActionTokenConfig("fast", horizon=4, max_tokens=12),
}


@pytest.fixture(scope="module")
def ar_model():
    torch.set_num_threads(1)  # as the engine does (docs/ros.md: 2 threads on 2 busy cores crawl)
    return build_model(action_model_config(get_preset("tiny"), 1024))


@pytest.fixture(scope="module")
def prefixes(ar_model):
    # short prefixes: no camera, a short instruction
    obs = [
        synthetic_observation(ar_model.cfg, i, f"task {i % 3}", camera_mask=(False, False))
        for i in range(FRAMES)
    ]
    return [ar_model.embed_prefix(o) for o in obs]


def run(model, scheduler, tokenizer, prefixes):
    arena = model.new_arena(20, 128)
    free = arena.free_slots()
    sched = SCHEDULERS[scheduler](model, arena, tokenizer)
    done = []
    for f, p in enumerate(prefixes):
        done += sched.cycle(p, f, 5 * f).done
    done += sched.drain()
    sched.close()
    assert arena.free_slots() == free
    return {d.frame: d for d in done}, sched.counters


@pytest.mark.parametrize("kind", ["bins", "fast"])
def test_pipelined_equals_sequential_and_naive_pipe_id_for_id(ar_model, prefixes, kind):
    tok = make_action_tokenizer(TOKENS[kind], ar_model.cfg, ar_model.tokenizer)
    seq, seq_c = run(ar_model, "sequential", tok, prefixes)
    pipe, pipe_c = run(ar_model, "actionflow", tok, prefixes)
    naive, _ = run(ar_model, "naive_pipe", tok, prefixes)
    assert sorted(seq) == sorted(pipe) == sorted(naive) == list(range(FRAMES))
    for f in range(FRAMES):
        assert pipe[f].tokens == seq[f].tokens == naive[f].tokens, f"frame {f}"
        assert np.array_equal(pipe[f].chunk, seq[f].chunk)
        assert pipe[f].tick == 5 * f  # stamped with its own observation's tick
    k = tok.max_tokens
    assert pipe_c.steps <= FRAMES + k - 1 < seq_c.steps  # one step per frame, plus the tail
    if kind == "fast":
        lengths = {len(d.tokens) for d in pipe.values()}
        assert max(lengths) == k and min(lengths) < k, lengths  # end token and cap both seen
        assert 0 < pipe_c.capped < FRAMES


def test_the_ring_never_leaks(ar_model, prefixes):
    tok = make_action_tokenizer(TOKENS["bins"], ar_model.cfg, ar_model.tokenizer)
    arena = ar_model.new_arena(12, 128)
    start = arena.free_slots()
    flow = ActionFlow(ar_model, arena, tok)
    assert arena.num_free == len(start) - tok.max_tokens
    done = 0
    for f in range(1000):
        done += len(flow.cycle(prefixes[f % 8], f, f).done)
        assert flow.in_flight() <= tok.max_tokens
        assert arena.num_free == len(start) - tok.max_tokens
        assert max(arena.slot_len(s) for s in flow.ring) <= prefixes[0].embeds.shape[0] + 16
    done += len(flow.drain())
    flow.close()
    assert done == 1000 and arena.free_slots() == start


def test_too_few_slots_for_the_ring_is_a_clear_error(ar_model):
    tok = make_action_tokenizer(TOKENS["bins"], ar_model.cfg, ar_model.tokenizer)
    arena = ar_model.new_arena(4, 128)
    with pytest.raises(ValueError, match="ring of K=8"):
        ActionFlow(ar_model, arena, tok)
    assert arena.num_free == 4


def ar_engine(model, kind="bins", unified=True):
    cfg = EngineConfig(
        num_slots=16, action_mode="ar", ar=TOKENS[kind], ar_unified=unified,
        history=0, blend=0,
    )  # fmt: skip
    return Engine(cfg, model)


def drive(engine, frames, start=0, ask=()):
    out = []
    for f in range(start, start + frames):
        if f in ask:
            engine.ask("where is the cup?")
        engine.observe(synthetic_observation(engine.model.cfg, f, "stack the blocks"))
        res = engine.cycle(tick=5 * f)
        out.append((res.frame, None if res.chunk is None else res.chunk.tobytes()))
        out += texts(res.events)
    return out, [f.tokens for f in engine.loop.flow.flights]


def texts(events):
    """(id without the epoch, text) of events that are not a restore's cancellations:
    a replay runs in a new timeline (new epoch), and two engines have their own."""
    return [(e.request_id.split("@")[0], e.text) for e in events
            if e.status is not Status.CANCELLED]  # fmt: skip


def test_capsule_mid_run_resumes_token_exactly(ar_model):
    engine = ar_engine(ar_model)
    engine.begin_episode()
    drive(engine, 11, ask=(3,))
    assert engine.loop.flow.in_flight() == 7  # frames in flight are part of the capsule
    engine.snapshot("mid")
    base = {r.split("@")[0] for r in engine.manager.requests}
    before = drive(engine, 9, start=11, ask=(12,))
    engine.restore("episode_start")
    drive(engine, 5, start=100)  # another episode overwrites the ring
    engine.restore("mid")
    after = drive(engine, 9, start=11, ask=(12,))
    # the requests live at "mid" ended above: a restore does not replay them (one final
    # event per id, docs/requests.md); everything else resumes token for token
    assert base and after == ([x for x in before[0] if x[0] not in base], before[1])
    assert any(isinstance(k, str) and k.startswith("answer-") for k, _ in after[0])


def test_language_in_the_same_packed_step_equals_separate_steps(ar_model):
    runs = {}
    for unified in (True, False):
        engine = ar_engine(ar_model, "bins", unified)
        engine.begin_episode()
        events, _ = drive(engine, 14, ask=(1, 2, 4))
        assert engine.queue.counters.chunks == 14 - 7  # K = 8: the first leaves at cycle 7
        events += texts(engine.loop.finish_all())
        chunks = [e for e in events if not isinstance(e[0], str)]
        final = {rid: text for rid, text in events if isinstance(rid, str)}
        runs[unified] = chunks, final, engine.manager.counters.tokens
    # separate steps give a new request its first decode one cycle earlier: the texts,
    # not the timing of their events, are what must match
    assert runs[True] == runs[False]
    assert set(runs[True][1]) == {"answer-1", "answer-2", "answer-3"} and runs[True][2] >= 3 * 4


def test_actions_enter_the_queue_at_their_observation_tick(ar_model):
    tok = make_action_tokenizer(ActionTokenConfig("bins", horizon=8), ar_model.cfg,
                                ar_model.tokenizer)  # fmt: skip
    manager = KVCacheManager(ar_model, 70, 256)
    queue = ActionQueue(8, 8)
    loop = ARLoop(manager, queue, LoopConfig(), tok)
    k = tok.max_tokens  # 64 tokens: the action of frame 0 leaves at cycle 63
    for f in range(k):
        res = loop.cycle(synthetic_observation(ar_model.cfg, f), f, tick=f // 16)
    assert res.chunk is not None and res.frame == 0 and res.chunk_tick == 0
    action, fresh = queue.pop(3)  # frame 0 was observed at tick 0: its step 3 is tick 3
    assert fresh and np.array_equal(action, res.chunk[3])
    with pytest.raises(ValueError, match="queue"):
        ARLoop(manager, ActionQueue(10, 8), LoopConfig(), tok)


def test_delta_actions_add_the_state_of_their_own_observation(ar_model):
    """A chunk leaves the pipeline K cycles after its observation: the robot state it
    is relative to must be that observation's, carried with the frame."""
    tok = make_action_tokenizer(TOKENS["bins"], ar_model.cfg, ar_model.tokenizer)
    robots = {"plain": RobotIO(8, 6), "delta": RobotIO(8, 6, delta_mask=(True, True, True))}
    chunks, states = {}, {}
    for name, robot in robots.items():
        loop = ARLoop(KVCacheManager(ar_model, 12, 320), ActionQueue(1, 6), LoopConfig(), tok,
                      robot=robot)  # fmt: skip
        chunks[name] = {}
        for f in range(12):
            obs = robot.model_observation(synthetic_observation(ar_model.cfg, f))
            states[f] = obs.robot_state
            res = loop.cycle(obs, f, tick=f)
            if res.chunk is not None:
                chunks[name][res.frame] = res.chunk
    assert sorted(chunks["delta"]) == [0, 1, 2, 3, 4]  # K = 8: frame 0 leaves at cycle 7
    for f, delta in chunks["delta"].items():
        expected = chunks["plain"][f].copy()
        expected[:, :3] += states[f][:3]
        assert np.array_equal(delta, expected), f
