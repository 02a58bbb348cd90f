"""Every request ends exactly once (issue 35, 1), at engine level: an id whose final event
has left the engine never produces another event, whatever is restored later (rollback by
name, by steps, reset, a capsule of another process). docs/requests.md states the rule."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

from embodied_kv.kv.manager import Status

from .test_session import cycles, make_engine

ROOT = Path(__file__).resolve().parents[2]


def final_counts(events):
    return Counter(e.request_id for e in events if e.done)


def events_of(events, ids):
    return [e for e in events if e.request_id in ids]


def test_rollback_by_name_does_not_replay_requests_that_ended(tiny_model, tmp_path):
    """The issue's reproduction: 4 questions, snapshot, all done, rollback, 60 cycles."""
    engine = make_engine(tiny_model, tmp_path)
    free = engine.manager.arena.num_free
    asked = [engine.ask(f"question {i}?")[0] for i in range(4)]
    events = cycles(engine, 1)
    engine.snapshot("mid", "host")
    assert set(asked) <= set(engine.manager.requests)  # live in the capsule
    events += cycles(engine, 60)
    assert final_counts(events) == Counter(asked)  # all 4 done, once
    engine.rollback("mid")
    assert engine.manager.requests == {}  # dropped from the restored state
    assert engine.manager.arena.num_free == free  # their slots released
    after = cycles(engine, 60)
    assert events_of(after, asked) == [], [(e.request_id, e.status) for e in after]
    engine.rollback("mid")  # and again
    assert events_of(cycles(engine, 5), asked) == []


def test_live_requests_continue_ended_ones_and_waiting_ones_do_not_restart(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path, max_decode_steps=1, answer_tokens=12)
    slots = engine.cfg.num_slots
    early = [engine.ask(f"early {i}?")[0] for i in range(slots + 2)]  # some wait for a slot
    events = cycles(engine, 1)
    waiting = {t.request_id for t in engine.policy.pending()}
    assert waiting
    engine.snapshot("busy", "disk")
    events += cycles(engine, 80)
    assert final_counts(events) == Counter(early)
    late = engine.ask("a late question?")[0]
    events += cycles(engine, 1)
    engine.snapshot("late", "gpu")
    events += cycles(engine, 1)
    assert late in engine.manager.requests  # still live at the rollback

    engine.rollback("late")  # `late` is in the capsule and live now: it goes on
    events += cycles(engine, 40)
    engine.rollback("busy")  # every id of `busy` has ended: nothing comes back
    assert engine.manager.requests == {} and engine.policy.pending() == []
    events += cycles(engine, 40)
    counts = final_counts(events)
    assert counts == Counter([*early, late]), counts - Counter([*early, late])
    assert {e.request_id: e.status for e in events if e.done}[late] is Status.OK


def test_rollback_by_steps_and_reset_do_not_replay_ended_requests(tiny_model, tmp_path):
    engine = make_engine(tiny_model, tmp_path, history=16)
    asked = [engine.ask(f"question {i}?")[0] for i in range(3)]
    events = cycles(engine, 1)  # boundary 0 holds them live
    events += cycles(engine, 12)
    assert final_counts(events) == Counter(asked)
    engine.rollback(steps_back=len(engine.history) - 1)  # the boundary after cycle 1
    assert engine.frame == 1 and engine.manager.requests == {}
    events += cycles(engine, 12)

    engine.snapshot("mark")
    cancelled = engine.ask("cut short by the reset?")[0]
    events += cycles(engine, 1)
    engine.snapshot("with_it")
    engine.reset()  # live at the reset: its one final event is CANCELLED
    events += cycles(engine, 3)
    engine.reset("with_it")  # a reset to a capsule that holds it: it stays ended
    events += cycles(engine, 20)
    counts = final_counts(events)
    assert counts == Counter([*asked, cancelled]), counts
    final = {e.request_id: e for e in events if e.done}[cancelled]
    assert final.status is Status.CANCELLED and "episode_start" in final.reason
    assert events_of(events[events.index(final) + 1 :], {cancelled}) == []


PROCESS_A = textwrap.dedent(
    """
    import json, sys
    from embodied_kv.engine.engine import Engine, EngineConfig
    from embodied_kv.kv.capsule_store import StoreConfig
    from embodied_kv.model.synthetic import synthetic_observation

    disk, finish = sys.argv[1], sys.argv[2] == "finish"
    cfg = EngineConfig(control_hz=0.01, max_decode_steps=3, answer_tokens=8, history=4,
                       store=StoreConfig(disk_dir=disk))
    engine = Engine(cfg)
    engine.begin_episode()

    def cycle():
        engine.observe(synthetic_observation(engine.model.cfg, 0, "pick up the red block"))
        result = engine.cycle(5 * engine.frame)
        return [e.request_id for e in result.events if e.done]

    asked = [engine.ask(f"question {i}?")[0] for i in range(4)]
    ended = cycle()
    engine.snapshot("mid", "disk")
    for _ in range(60 if finish else 0):
        ended += cycle()
    print(json.dumps({"asked": asked, "ended": ended}))
    """
)


def run_process_a(disk, finish: bool) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", PROCESS_A, str(disk), "finish" if finish else "stop"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_capsule_of_another_process_does_not_replay_what_ended_there(tiny_model, tmp_path):
    """Process A snapshots to disk with 4 answers live and lets them finish; process B (this
    one) restores the capsule: the 4 ids have ended, nothing of them comes back."""
    a = run_process_a(tmp_path, finish=True)
    assert sorted(a["ended"]) == sorted(a["asked"])
    b = make_engine(tiny_model, tmp_path)
    b.rollback("mid")
    assert b.manager.requests == {}
    events = cycles(b, 30)
    assert events_of(events, set(a["asked"])) == []
    b.rollback("mid")  # and again, after B's own cycles
    assert events_of(cycles(b, 5), set(a["asked"])) == []


def test_a_capsule_of_a_process_that_did_not_finish_them_ends_them_once(tiny_model, tmp_path):
    """Process A exits with the answers live (never ended there): B carries them to their one
    final event; a third engine on the same folder then knows they ended in B."""
    a = run_process_a(tmp_path, finish=False)
    assert a["ended"] == []
    b = make_engine(tiny_model, tmp_path)
    b.rollback("mid")
    events = cycles(b, 30)
    assert final_counts(events) == Counter(a["asked"])
    assert all(e.status is Status.OK for e in events if e.done)
    c = make_engine(tiny_model, tmp_path)  # a later process on the same folder
    c.rollback("mid")
    assert c.manager.requests == {}
    assert events_of(cycles(c, 10), set(a["asked"])) == []
