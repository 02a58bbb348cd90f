"""OxyGen's claims as tests: shared prefill, cross-frame batching, deadlines, slots."""

import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.frame_loop import FrameLoop
from embodied_kv.engine.isolated import IsolatedRunner
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.timing import Stopwatch

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


QUESTIONS = {2: "where is the cup?", 5: "what next?", 6: "why?"}


def base(request_id):
    """`answer-1@<epoch>` -> `answer-1`: each runner's policy has its own epoch."""
    return request_id.split("@")[0]


def run(runner, obs, finish):
    texts, first_frame, done_frame, chunks = {}, {}, {}, []
    for f, o in enumerate(obs):
        if f in QUESTIONS:
            runner.policy.ask(QUESTIONS[f])
        res = runner.cycle(o, f, tick=5 * f)
        chunks.append(res.chunk)
        for e in res.events:
            first_frame.setdefault(base(e.request_id), f)
            if e.done:
                texts[base(e.request_id)], done_frame[base(e.request_id)] = e.text, f
    if finish:
        for e in runner.finish_all():
            if e.done:
                texts[base(e.request_id)], done_frame[base(e.request_id)] = e.text, len(obs)
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
        == {f"narration-{f}" for f in range(0, 9, 2)} | {"answer-1", "answer-2", "answer-3"}
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
    done = {base(e.request_id): e for c in cycles for e in c.events if e.done}
    loop.policy.cfg = LoopConfig(period_s=period, narrate_every=0)
    for f in range(10, 80):
        res = loop.cycle(obs[f % 10], f, 5 * f)
        assert res.cycle_s <= period
        done.update({base(e.request_id): e for e in res.events if e.done})
        if not loop.manager.requests:
            break
    assert set(done) == {f"narration-{f}" for f in range(10)}
    assert all(e.truncated or len(e.text) > 0 for e in done.values())


def test_one_slow_decode_step_does_not_stop_language_for_good(tiny_model):
    cfg = LoopConfig(period_s=0.1, narrate_every=0, answer_tokens=30)
    clock = VirtualClock()
    loop = slow_loop(tiny_model, cfg, clock, step_s=0.01, prefill_s=0.02)
    obs = observations(tiny_model, 9)
    loop.warmup(obs[0])
    loop.policy.ask("still there?")
    loop.cost._by_batch = {b: 5.0 for b in range(1, 17)}  # a 5 s step once (a load spike)
    steps = [loop.cycle(o, f, 5 * f).decode_steps for f, o in enumerate(obs)]
    assert steps[:2] == [0, 0] and sum(steps) >= 3  # deferred, then a step every third cycle
    assert loop.cost.estimate(1) < 5.0  # ... which brings the estimate back


def test_a_question_ends_the_oldest_narration_when_slots_run_out(tiny_model):
    cfg = LoopConfig(period_s=10.0, narrate_every=1, narration_tokens=200, max_decode_steps=1)
    loop = make_loop(tiny_model, cfg, num_slots=3)
    events = []
    for f, o in enumerate(observations(tiny_model, 6)):
        if f == 4:
            urgent = loop.policy.ask("stop?")
        events += loop.cycle(o, f, f).events
    c = loop.manager.counters
    truncated = {base(e.request_id): e for e in events if e.done and e.truncated}
    # narrations 0 and 1 held the two slots one frame leaves; the question took the oldest's
    assert set(truncated) == {"narration-0"} and c.truncated == 1
    assert truncated["narration-0"].reason == f"slot given to {urgent}"
    assert urgent in loop.manager.requests
    assert c.narrations_skipped == 4  # frames 2..5: no room (at 4 the question took it)
    assert c.frames == 6 and loop.manager.arena.num_free >= 1  # one kept for the next frame
    # every frame still got its chunk while slots were exhausted
    assert loop.queue.counters.chunks == 6


def test_slot_exhaustion_skips_an_optional_narration_and_defers_a_question(tiny_model):
    cfg = LoopConfig(
        period_s=10.0, narrate_every=1, narration_tokens=200, answer_tokens=200, max_decode_steps=1
    )
    loop = make_loop(tiny_model, cfg, num_slots=2)
    obs = observations(tiny_model, 3)
    first = loop.policy.ask("status?")
    loop.cycle(obs[0], 0, 0)  # the answer takes the one slot a frame can spare
    second = loop.policy.ask("and now?")
    loop.cycle(obs[1], 1, 5)  # no room: the question waits, narration-1 is skipped
    c = loop.manager.counters
    assert c.narrations_skipped == 2 and c.truncated == 0 and c.deferred == 1
    assert set(loop.manager.requests) == {first}
    assert [t.request_id for t in loop.policy.pending()] == [second]


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
    a1 = loop.policy.ask("what is on the table?")
    a2 = loop.policy.ask("is the drawer open?")
    ev = {e.request_id: e for e in loop.cycle(o, 0, 0).events if e.done}
    ev.update({e.request_id: e for e in loop.finish_all() if e.done})
    assert ev[a1].kind is TaskKind.ANSWER and set(ev) == {a1, a2}
    assert loop.manager.counters.requests == 2


def test_noise_drawn_ahead_is_make_noise_in_bytes_and_off_the_action_path(tiny_model):
    """Frames 0, 1, 2 in order, then a jump to 7: the loop's chunks are the chunks of
    `make_noise(seed + frame)` (a private prefill), bytes; frames 1 and 2 find their noise
    drawn ahead (after the previous chunk), the first and the jump draw it then."""
    m = tiny_model
    cfg = LoopConfig(period_s=10.0, narrate_every=0)
    loop = make_loop(m, cfg)
    obs = observations(m, 4)
    frames = (0, 1, 2, 7)
    pairs = enumerate(zip(obs, frames, strict=True))
    got = [loop.cycle(o, f, tick=5 * i).chunk for i, (o, f) in pairs]
    assert (loop.noise.hits, loop.noise.misses) == (2, 2)
    assert loop.noise.seed == cfg.seed + 8  # frame 8's noise waits in the buffer
    for o, f, chunk in zip(obs, frames, got, strict=True):
        arena = m.new_arena(1, MAX_LEN)
        slot = arena.allocate()
        prefix = m.embed_prefix(o)
        m.prefill(arena, slot, prefix)
        want = m.sample_actions(arena, slot, prefix.embeds.shape[0], m.make_noise(cfg.seed + f))
        assert np.asarray(want.numpy(), np.float64).tobytes() == chunk.tobytes(), f


def test_no_clock_read_between_prefill_and_denoise(tiny_model):
    """On CUDA the loop's clock synchronizes the device (embodied_kv/timing.py): the cycle
    reads it at its start, once the chunk is on the host and after, never between the
    prefill and the denoise (there the CUDA path records an event); prefill_s still
    measures the prefill (its mark on the CPU is the clock at that point)."""
    log = []
    t = [0.0]

    def clock():
        t[0] += 1.0
        log.append((f"clock@{sys._getframe(1).f_code.co_name}", t[0]))
        return t[0]

    c = tiny_model.cfg
    queue = ActionQueue(c.action_horizon, c.action_dim)
    loop = FrameLoop(KVCacheManager(tiny_model, 4, MAX_LEN), queue,
                     LoopConfig(period_s=1e9, narrate_every=0), clock=clock)  # fmt: skip
    prefill, sample = loop.manager.prefill_frame, loop.model.sample_actions

    def logged(name, fn):
        def call(*args, **kwargs):
            log.append((name + ":in", None))
            out = fn(*args, **kwargs)
            log.append((name + ":out", None))
            return out

        return call

    loop.manager.prefill_frame = logged("prefill", prefill)
    loop.model.sample_actions = logged("sample", sample)
    try:
        res = loop.cycle(observations(tiny_model, 1)[0], 0, tick=0)
    finally:
        del loop.model.sample_actions  # the instance attribute: the method again
    names = [n for n, _ in log]
    between = names[names.index("prefill:out") + 1 : names.index("sample:in")]
    # only the Stopwatch's mark, which on CUDA records an event and reads no clock
    assert between == ["clock@mark"], between
    assert names[:2] == ["clock@start", "prefill:in"]  # the cycle's boundary
    after = names[names.index("sample:out") :]
    assert after.count("clock@cycle") >= 2  # once the chunk is on the host, and the end
    assert res.prefill_s == 1.0 and res.action_s > res.prefill_s  # fake seconds


def test_stopwatch_marks_read_no_clock_on_cuda():
    """The CUDA branch: a mark is an event, the clock is read by start() only."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA events need a GPU")
    reads = []
    watch = Stopwatch("cuda", lambda: reads.append(1) or torch.cuda.synchronize() or 0.0)
    watch.start()
    x = torch.randn(512, 512, device="cuda")
    point = watch.mark()
    y = x @ x  # queued behind the mark
    assert len(reads) == 1 and isinstance(point, torch.cuda.Event)
    y.cpu()
    assert watch.seconds(point) >= 0.0


class HeadCalls(TorchDispatchMode):
    """GEMMs whose output is [R, vocab]: the tied LM head, as the dispatcher sees it."""

    def __init__(self, vocab, log):
        super().__init__()
        self.vocab, self.log = vocab, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and (
            out.shape[-1] == self.vocab
        ):
            self.log.append(("head", None))
        return out


@pytest.mark.parametrize("graphs", ["off", "emulate"])
def test_the_lm_head_runs_only_for_a_language_request_after_the_action(tiny_model, graphs):
    """No request on a frame: its prefill runs no LM head. A question on a frame: the head
    runs after the chunk (when the request starts), and the request's first token comes
    from the same logits as an eager prefill's (bytes)."""
    from embodied_kv.engine.graphs import GraphRunner
    from embodied_kv.model.lazy_logits import LazyLogits

    m = tiny_model
    loop = make_loop(m, LoopConfig(period_s=1e9, narrate_every=0, max_decode_steps=1))
    if graphs == "emulate":
        m.graphs = GraphRunner(m, loop.manager.arena, mode="emulate")
    log = []
    sample = m.sample_actions

    def logged(*args, **kwargs):
        out = sample(*args, **kwargs)
        log.append(("sample:out", None))
        return out

    m.sample_actions = logged
    obs = observations(m, 2)
    try:
        with HeadCalls(m.cfg.vocab_size, log):
            loop.cycle(obs[0], 0, tick=0)
            quiet = [n for n, _ in log]
            log.clear()
            loop.policy.ask("where is the cup?")
            loop.cycle(obs[1], 1, tick=5)
    finally:
        del m.sample_actions
        m.graphs = None
    assert quiet == ["sample:out"]  # no head: nothing read the frame's logits
    names = [n for n, _ in log]
    first_head = names.index("head")
    assert names.index("sample:out") < first_head  # the head after the chunk
    # the lazy logits are the eager head's, bytes (the same [R, W] x [W, V] GEMM)
    arena = m.new_arena(2, MAX_LEN)
    a, b = arena.allocate(), arena.allocate()
    prefix = m.embed_prefix(obs[1])
    lazy = m.prefill(arena, a, prefix, lazy=True)
    assert isinstance(lazy, LazyLogits) and not lazy.computed
    assert torch.equal(lazy.value(), m.prefill(arena, b, prefix)) and lazy.computed


def test_a_persistent_launch_that_gave_up_waiting_is_counted(tiny_model):
    """A kept workspace whose launch had a wait run out (its error flag set: its outputs
    were wrong) shows in the loop's counters at the next check, every WAIT_CHECK_CYCLES
    cycles, where the chunk's copy has synced the device."""
    from embodied_kv.engine.frame_loop import WAIT_CHECK_CYCLES
    from embodied_kv.kernels.expert_layer_step import StepWork

    loop = make_loop(tiny_model, LoopConfig(period_s=1.0, narrate_every=0))
    obs = observations(tiny_model, 1)[0]
    loop.warmup(obs)
    loop.cycle(obs, 0, 0)
    assert loop.counters.wait_timeouts == 0
    e = tiny_model.cfg.expert
    h = torch.zeros(tiny_model.cfg.action_horizon, e.width)
    heads = (e.heads, e.kv_heads, e.head_dim)
    work = StepWork.new(h, torch.zeros((e.heads + 2 * e.kv_heads) * e.head_dim, e.width),
                        torch.zeros(e.width, e.heads * e.head_dim), torch.zeros(e.width, e.mlp),
                        heads, 64)  # fmt: skip
    work.phases[-1] = 1  # the error flag a timed-out wait sets
    steps = tiny_model.expert.workspaces._steps
    steps["flagged"] = work
    try:
        for f in range(1, WAIT_CHECK_CYCLES + 1):
            loop.cycle(obs, f, f)
        assert loop.counters.wait_timeouts == 1
    finally:
        del steps["flagged"]
