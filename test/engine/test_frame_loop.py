"""OxyGen's claims as tests: shared prefill, cross-frame batching, deadlines, slots."""

import numpy as np

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.frame_loop import FrameLoop
from embodied_kv.engine.isolated import IsolatedRunner
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.model.synthetic import synthetic_observation

MAX_LEN = 512


def make_loop(model, cfg, num_slots=8):
    c = model.cfg
    queue = ActionQueue(c.action_horizon, c.action_dim)
    return FrameLoop(KVCacheManager(model, num_slots, MAX_LEN), queue, cfg)


def make_isolated(model, cfg):
    c = model.cfg
    return IsolatedRunner(model, ActionQueue(c.action_horizon, c.action_dim), cfg, MAX_LEN)


def observations(model, n):
    return [synthetic_observation(model.cfg, i, f"task number {i % 3}") for i in range(n)]


QUESTIONS = {2: ("q-a", "where is the cup?"), 5: ("q-b", "what next?"), 6: ("q-c", "why?")}


def run(runner, obs, finish):
    texts, first_frame, done_frame, chunks = {}, {}, {}, []
    for f, o in enumerate(obs):
        if f in QUESTIONS:
            runner.policy.ask(*QUESTIONS[f])
        res = runner.cycle(o, f, tick=5 * f)
        chunks.append(res.chunk)
        for e in res.events:
            first_frame.setdefault(e.request_id, f)
            if e.done:
                texts[e.request_id], done_frame[e.request_id] = e.text, f
    if finish:
        for e in runner.finish_all():
            if e.done:
                texts[e.request_id], done_frame[e.request_id] = e.text, len(obs)
    return texts, first_frame, done_frame, chunks


def test_cross_frame_batched_text_equals_isolated_and_chunks_equal_private_prefill(tiny_model):
    cfg = LoopConfig(
        period_s=10.0, narrate_every=2, narration_tokens=24, answer_tokens=40, max_decode_steps=6
    )
    obs = observations(tiny_model, 9)
    u_text, u_first, u_done, u_chunks = run(make_loop(tiny_model, cfg), obs, finish=True)
    i_text, _, _, i_chunks = run(make_isolated(tiny_model, cfg), obs, finish=False)
    assert (
        set(u_text)
        == set(i_text)
        == {f"narration-{f}" for f in range(0, 9, 2)} | {"q-a", "q-b", "q-c"}
    )
    for rid in i_text:
        assert u_text[rid] == i_text[rid], rid
    # requests lived across frames, started and finished at different frames
    assert any(u_done[r] > u_first[r] for r in u_text)
    assert len(set(u_first.values())) > 2 and len(set(u_done.values())) > 2
    # the chunk from the shared prefix = the chunk from a private prefill (bytes)
    for a, b in zip(u_chunks, i_chunks, strict=True):
        assert a.tobytes() == b.tobytes()


def test_batch_really_changes_across_frames(tiny_model):
    cfg = LoopConfig(period_s=10.0, narrate_every=1, narration_tokens=12, max_decode_steps=4)
    loop = make_loop(tiny_model, cfg)
    sizes = []
    for f, o in enumerate(observations(tiny_model, 6)):
        loop.cycle(o, f, f)
        sizes.append(len(loop.manager.live()))
    assert len(set(sizes)) > 1 and max(sizes) >= 2


class VirtualClock:
    """Time that moves only when the test says so: the loop's deadline arithmetic is
    checked exactly, whatever else the machine is doing."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def slow_loop(model, cfg, clock, step_s, prefill_s):
    loop = make_loop(model, cfg, num_slots=16)
    loop.clock = clock
    real_step, real_prefill = loop.manager.decode_step, loop.manager.prefill_frame

    def slow_step():
        clock.now += step_s
        return real_step()

    def timed_prefill(*a):
        clock.now += prefill_s
        return real_prefill(*a)

    loop.manager.decode_step, loop.manager.prefill_frame = slow_step, timed_prefill
    return loop


def test_slow_decode_never_breaks_the_period_and_nothing_is_lost(tiny_model):
    period = 0.1
    cfg = LoopConfig(period_s=period, narrate_every=1, narration_tokens=6, answer_tokens=6)
    clock = VirtualClock()
    loop = slow_loop(tiny_model, cfg, clock, step_s=0.035, prefill_s=0.02)
    obs = observations(tiny_model, 10)
    loop.warmup(obs[0])
    cycles = [loop.cycle(o, f, 5 * f) for f, o in enumerate(obs)]
    assert max(c.cycle_s for c in cycles) <= period
    assert loop.counters.overruns == 0 and loop.counters.action_late == 0
    assert all(c.decode_steps == 2 for c in cycles)  # 0.02 + 2 * 0.035 fits, a third not
    assert loop.counters.decode_deferred == 10  # the load did not fit: visible, not hidden
    # nothing lost: cycles without new narration drain every request
    done = {e.request_id: e for c in cycles for e in c.events if e.done}
    loop.policy.cfg = LoopConfig(period_s=period, narrate_every=0)
    for f in range(10, 80):
        res = loop.cycle(obs[f % 10], f, 5 * f)
        assert res.cycle_s <= period
        done.update({e.request_id: e for e in res.events if e.done})
        if not loop.manager.requests:
            break
    assert set(done) == {f"narration-{f}" for f in range(10)}
    assert all(e.truncated or len(e.text) > 0 for e in done.values())


def test_slot_exhaustion_truncates_the_oldest_request(tiny_model):
    cfg = LoopConfig(period_s=10.0, narrate_every=1, narration_tokens=200, max_decode_steps=1)
    loop = make_loop(tiny_model, cfg, num_slots=3)
    events = []
    for f, o in enumerate(observations(tiny_model, 6)):
        if f == 4:
            loop.policy.ask("urgent", "stop?")
        events += loop.cycle(o, f, f).events
    c = loop.manager.counters
    truncated = {e.request_id for e in events if e.done and e.truncated}
    assert c.truncated >= 1 and truncated  # the oldest narration ended early, flagged
    assert "urgent" in {r.request_id for r in loop.manager.requests.values()}
    assert c.frames == 6 and loop.manager.arena.num_free >= 0
    # every frame still got its chunk while slots were exhausted
    assert loop.queue.counters.chunks == 6


def test_slot_exhaustion_skips_an_optional_narration(tiny_model):
    cfg = LoopConfig(
        period_s=10.0, narrate_every=1, narration_tokens=200, answer_tokens=200, max_decode_steps=1
    )
    loop = make_loop(tiny_model, cfg, num_slots=2)
    obs = observations(tiny_model, 2)
    loop.cycle(obs[0], 0, 0)  # narration-0 holds one slot
    loop.policy.ask("q", "status?")  # adopts frame 1's slot; no slot left for narration-1
    loop.cycle(obs[1], 1, 5)
    c = loop.manager.counters
    assert c.narrations_skipped == 1 and c.truncated == 0
    assert set(loop.manager.requests) == {"narration-0", "q"}


def test_empty_and_over_long_instructions(tiny_model):
    cfg = LoopConfig(period_s=10.0, narrate_every=1, narration_tokens=4, max_decode_steps=8)
    loop = make_loop(tiny_model, cfg)
    c = tiny_model.cfg
    empty = synthetic_observation(c, 1, "")
    res = loop.cycle(empty, 0, 0)
    assert np.isfinite(res.chunk).all() and res.chunk.shape == (c.action_horizon, c.action_dim)
    long = synthetic_observation(c, 2, "move " * 500)
    res = loop.cycle(long, 1, 5)
    assert loop.manager.counters.prompts_truncated == 1
    assert res.prefix_len == c.num_cameras * c.vision.tokens + c.max_text_tokens
    assert np.isfinite(res.chunk).all()


def test_answer_requests_use_the_question(tiny_model):
    cfg = LoopConfig(period_s=10.0, answer_tokens=8, max_decode_steps=16)
    loop = make_loop(tiny_model, cfg)
    o = observations(tiny_model, 1)[0]
    loop.policy.ask("a1", "what is on the table?")
    loop.policy.ask("a2", "is the drawer open?")
    ev = {e.request_id: e for e in loop.cycle(o, 0, 0).events if e.done}
    ev.update({e.request_id: e for e in loop.finish_all() if e.done})
    assert ev["a1"].kind is TaskKind.ANSWER and set(ev) == {"a1", "a2"}
    assert loop.manager.counters.requests == 2
