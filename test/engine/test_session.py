"""The session as one state that cannot be corrupted (issue 10), at engine level:
a control loop that cannot die, unique request ids, admission with whole prompts,
a final event for every request, reserved capsule names, complete capsules."""

import pytest

from embodied_kv.engine.engine import EPISODE_START, Engine, EngineConfig
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.kv.manager import Status, TaskKind
from embodied_kv.model.synthetic import synthetic_observation


def make_engine(model, disk, **kw):
    cfg = dict(
        control_hz=0.01,  # a period of minutes: decode work per cycle is max_decode_steps
        max_decode_steps=3,
        answer_tokens=8,
        history=4,
        store=StoreConfig(disk_dir=str(disk)),
    )
    cfg.update(kw)
    engine = Engine(EngineConfig(**cfg), model=model)
    engine.begin_episode()
    return engine


def cycles(engine, n, seed=0, instruction="pick up the red block"):
    """n cycles on one fixed observation -> every event, in order."""
    events = []
    for _ in range(n):
        engine.observe(synthetic_observation(engine.model.cfg, seed, instruction))
        result = engine.cycle(5 * engine.frame)
        events += result.events if result is not None else []
    return events


def finals(events):
    return {e.request_id: e for e in events if e.done}


def test_restored_disk_capsule_of_an_earlier_process_does_not_collide(tiny_model, tmp_path):
    first = make_engine(tiny_model, tmp_path)
    asked = [first.ask(f"question {i}?")[0] for i in range(3)]
    cycles(first, 1)
    first.snapshot("saved", "disk")  # answers live in it
    live = set(first.manager.requests)
    assert set(asked) <= live

    second = make_engine(tiny_model, tmp_path)  # another process: same weights, same folder
    second.rollback("saved")
    new = [second.ask(f"question {i}?")[0] for i in range(3)]
    assert not set(new) & live  # the ids of the earlier process are not handed out again
    events = cycles(second, 4)
    assert second.faults.failures == 0
    done = finals(events + second.loop.finish_all())
    assert set(new) <= set(done) and all(done[r].status is Status.OK for r in new)


def test_failed_cycle_releases_its_slots_then_failures_hold(tiny_model, tmp_path, monkeypatch):
    engine = make_engine(tiny_model, tmp_path, max_cycle_failures=3)
    cycles(engine, 2)
    free_before, frame = engine.manager.arena.num_free, engine.frame
    real = tiny_model.sample_actions

    def broken(*args):
        raise RuntimeError("injected: the action expert failed")

    monkeypatch.setattr(tiny_model, "sample_actions", broken)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected"):
            cycles(engine, 1)
        assert engine.manager.arena.num_free == free_before and engine.frame == frame
    assert not engine.faults.safe
    monkeypatch.setattr(tiny_model, "sample_actions", real)
    cycles(engine, 1)  # the next cycle starts clean
    assert engine.faults.consecutive == 0 and engine.frame == frame + 1

    monkeypatch.setattr(tiny_model, "sample_actions", broken)
    for _ in range(3):
        with pytest.raises(RuntimeError):
            cycles(engine, 1)
    assert engine.faults.safe and "3 engine cycles failed in a row" in engine.faults.safe_reason
    last = engine.queue.pop(10_000)
    assert engine.queue.pop(10_001)[0].tobytes() == last[0].tobytes()  # the last action, held
    assert cycles(engine, 3) == [] and engine.faults.failures == 5  # no cycle runs: no new failure
    monkeypatch.setattr(tiny_model, "sample_actions", real)
    engine.reset()  # a known state: the loop runs again
    assert not engine.faults.safe
    cycles(engine, 1)
    assert engine.frame == 1 and engine.faults.failures == 5  # diagnostics are not rolled back


def test_burst_of_questions_gets_whole_prompts_or_refusals(tiny_model, tmp_path):
    question = "what do you see?"
    alone = make_engine(tiny_model, tmp_path / "a", max_decode_steps=8)
    ref_id, _ = alone.ask(question)
    ref = finals(cycles(alone, 1, seed=3) + alone.loop.finish_all())[ref_id]

    engine = make_engine(tiny_model, tmp_path / "b", max_decode_steps=2)
    asked, refused = [], {}
    for _ in range(500):
        rid, refusal = engine.ask(question)
        asked.append(rid)
        if refusal is not None:
            refused[rid] = refusal
    assert len(refused) == 500 - engine.cfg.max_pending
    assert all(e.status is Status.REFUSED and "max_pending" in e.reason for e in refused.values())
    assert engine.counters.refused_queue_full == len(refused)
    events = cycles(engine, 12, seed=3)
    done = finals(events + engine.loop.finish_all())
    served = [r for r in asked if r not in refused]
    assert set(served) <= set(done)
    for rid in served:  # every one saw the whole prefix and question: the same answer
        assert done[rid].status is Status.OK and done[rid].text == ref.text, rid
    assert engine.manager.counters.deferred > 0  # they waited for slots, in order


def test_plan_that_cannot_fit_is_refused_with_a_reason(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path)
    for i in range(4):
        engine.update_memory(0, f"segment-{i}", "x" * 107, max_segments=16)
    rid, refusal = engine.plan("put the cup in the bowl")
    assert refusal is not None and refusal.status is Status.REFUSED and refusal.done
    assert "does not fit" in refusal.reason and refusal.request_id == rid
    assert engine.policy.pending() == []
    for i in (3, 2, 1):
        engine.update_memory(2, f"segment-{i}", "", 16)
    rid, refusal = engine.plan("put the cup in the bowl")
    assert refusal is None
    done = finals(cycles(engine, 1) + engine.loop.finish_all())
    assert done[rid].status is Status.OK and done[rid].kind is TaskKind.PLAN


def test_requests_in_flight_at_reset_and_rollback_end_cancelled(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path, narrate_every=1, max_decode_steps=1)
    live = [engine.ask("first?")[0]]
    cycles(engine, 1)
    engine.snapshot("mark")
    live += [engine.ask("second?")[0]]
    cycles(engine, 1)
    waiting = engine.ask("third?")[0]  # still queued at the rollback
    open_ids = {r.request_id for r in engine.manager.live()} | {waiting}
    engine.rollback("mark")
    events = cycles(engine, 1)
    cancelled = {e.request_id for e in events if e.status is Status.CANCELLED}
    kept = set(engine.manager.requests)  # restored from the capsule: they go on
    assert cancelled == open_ids - kept and waiting in cancelled and live[1] in cancelled
    assert all(e.done for e in events if e.request_id in cancelled)
    engine.rollback("mark")  # frame 1 again: its new narration gets a new id
    again = cycles(engine, 1)

    def narration_of_frame_1(evs):
        return {e.request_id for e in evs if e.kind is TaskKind.NARRATION and e.frame == 1
                and e.status is not Status.CANCELLED}  # fmt: skip

    assert len(narration_of_frame_1(events)) == len(narration_of_frame_1(again)) == 1
    assert narration_of_frame_1(events) != narration_of_frame_1(again)
    open_now = {r.request_id for r in engine.manager.live()}
    engine.reset()
    events = cycles(engine, 1)
    assert open_now and {e.request_id for e in events if e.status is Status.CANCELLED} >= open_now


def test_engine_names_are_out_of_clients_reach(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path)
    cycles(engine, 2)
    for name in (EPISODE_START, engine.history[-1], "auto-1", "abc\n", "bad\x00name", "../up"):
        with pytest.raises(ValueError, match="reserved|bad capsule name"):
            engine.snapshot(name, "gpu")
    assert engine.store.info(EPISODE_START).pinned
    size = engine.store.info(EPISODE_START).nbytes
    for i in range(6):  # budget pressure from clients: the episode start stays
        engine.snapshot(f"client-{i}", "gpu")
    engine.store.cfg = StoreConfig(gpu_bytes=size, host_bytes=size, disk_dir=str(tmp_path))
    engine.snapshot("one_more", "gpu")
    assert engine.store.info(EPISODE_START).tier == "gpu"
    engine.reset("")
    assert engine.frame == 0


def test_rollback_by_steps_stays_in_its_timeline(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path)
    cycles(engine, 4)
    engine.reset()
    with pytest.raises(ValueError, match="0 boundaries kept"):
        engine.rollback(steps_back=1)
    cycles(engine, 3)
    engine.rollback(steps_back=1)
    assert engine.frame == 2  # in the new episode
    cycles(engine, 2)
    engine.snapshot("mark")
    cycles(engine, 2)
    engine.rollback("mark")
    with pytest.raises(ValueError, match="0 boundaries kept"):
        engine.rollback(steps_back=1)


def test_reset_empties_memory_and_pending_and_capsules_carry_them(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path, max_decode_steps=1)
    engine.update_memory(0, "cup", "on the shelf", 16)
    cycles(engine, 1)
    for i in range(engine.cfg.num_slots + 2):
        engine.ask(f"q{i}?")
    cycles(engine, 1)
    pending = [t.request_id for t in engine.policy.pending()]
    assert pending  # more questions than slots: some wait
    engine.snapshot("full", "disk")
    counters = engine.policy.state_meta()["next"]
    tokens = engine.manager.counters.tokens

    engine.reset()
    assert engine.memory.segments == {} and engine.policy.pending() == []
    assert engine.manager.requests == {} and engine.manager.counters.tokens >= tokens
    cancelled = finals(cycles(engine, 1))
    assert set(pending) <= set(cancelled)  # their one final event: CANCELLED by the reset
    stored = engine.store.load("full").meta["extras"]["policy"]["pending"]
    assert [t["request_id"] for t in stored] == pending  # the capsule carries the queue
    engine.restore("full")
    assert {k: s.text for k, s in engine.memory.segments.items()} == {"cup": "on the shelf"}
    assert engine.policy.pending() == []  # ended at the reset: not brought back (issue 35)
    assert engine.policy.state_meta()["next"] == counters
    assert engine.instruction == "pick up the red block" and engine._obs is not None


def session_bytes(engine):
    """Everything a restore may change, as bytes and plain values."""
    from embodied_kv.kv.capsule import manager_meta

    arena = engine.manager.arena
    sections = {k: (o.state_meta(), {n: t.numpy().tobytes() for n, t in o.state_tensors().items()})
                for k, o in engine.sections().items()}  # fmt: skip
    return (
        arena.k.numpy().tobytes(),
        arena.v.numpy().tobytes(),
        arena.length.tolist(),
        arena.next_pos.tolist(),
        arena.free_slots(),
        manager_meta(engine.manager),
        repr(sections),
    )


def store_bytes(engine):
    files = {p.name: p.read_bytes() for p in sorted(engine.store.disk_dir.iterdir())}
    return [(i.name, i.tier, i.nbytes, i.pinned, i.digest) for i in engine.store.list()], files


def test_every_failed_restore_leaves_session_and_store_unchanged(tiny_model, tmp_path, monkeypatch):
    engine = make_engine(tiny_model, tmp_path, narrate_every=1)
    engine.update_memory(0, "cup", "on the shelf", 16)
    cycles(engine, 2)
    engine.snapshot("on_disk", "disk")
    engine.snapshot("in_host", "host")
    engine.ask("a question in flight?")
    cycles(engine, 2, seed=9)
    live, store = session_bytes(engine), store_bytes(engine)

    def fail(*args, **kwargs):
        raise OSError("injected failure")

    def invalid(*args, **kwargs):
        raise ValueError("injected: section invalid")

    stages = [  # (what fails, the capsule restored)
        ((engine.store, "_read", fail), "on_disk"),  # reading the payload
        ((engine.memory, "check_state", invalid), "on_disk"),  # validating a section
        ((engine.queue, "check_state", invalid), "in_host"),
        ((engine.policy, "check_state", invalid), EPISODE_START),
    ]
    for (obj, attr, fn), name in stages:
        with monkeypatch.context() as m:
            m.setattr(obj, attr, fn)
            with pytest.raises((OSError, ValueError), match="injected"):
                engine.restore(name)
        assert session_bytes(engine) == live, (attr, name)
        assert store_bytes(engine) == store, (attr, name)
    for name in ("nope", "auto-none"):
        with pytest.raises(ValueError, match="unknown capsule"):
            engine.rollback(name)
        assert session_bytes(engine) == live and store_bytes(engine) == store

    # a promotion that would have to demote another capsule onto a failing disk: the
    # restore happens, the store stays as it was
    engine.restore(EPISODE_START)  # a restore drops the old timeline's history: do it first
    engine.snapshot("extra", "gpu")
    size = engine.store.info("in_host").nbytes
    engine.store.cfg = StoreConfig(gpu_bytes=engine.store.bytes_by_tier()["gpu"] + size - 1,
                                   host_bytes=0, disk_dir=str(tmp_path))  # fmt: skip
    store = store_bytes(engine)
    monkeypatch.setattr(engine.store, "_write", fail)
    engine.restore("in_host")
    assert engine.frame == 2  # restored
    assert store_bytes(engine) == store  # "extra" could not go to disk: nothing moved
    assert not list(tmp_path.glob(".*.tmp"))

    # a failed snapshot over an existing name keeps the old capsule and its files
    with pytest.raises(OSError, match="injected"):
        engine.snapshot("on_disk", "disk")
    assert store_bytes(engine) == store


def test_disk_restore_with_every_other_tier_full_of_pins(tiny_model, tmp_path):
    """Issue 10, 6: this wiped the action chunk and left the capsule without tensors."""
    engine = make_engine(tiny_model, tmp_path)
    cycles(engine, 2)
    engine.snapshot("saved", "disk")
    size = engine.store.info("saved").nbytes
    chunk = engine.queue.state_tensors()["chunk"].clone()
    engine.store.cfg = StoreConfig(gpu_bytes=size // 2, host_bytes=size,
                                   disk_dir=str(tmp_path))  # fmt: skip
    engine.snapshot("pin_a", "host", pin=True)
    cycles(engine, 2)
    engine.restore("saved")
    assert engine.store.info("saved").tier == "disk"  # could not be promoted: stays, whole
    assert (tmp_path / "saved.safetensors").is_file()
    assert engine.queue.state_tensors()["chunk"].numpy().tobytes() == chunk.numpy().tobytes()
    engine.restore("saved")  # and again
    assert engine.frame == 2
