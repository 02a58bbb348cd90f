"""The robot session as one state a client cannot corrupt (issue 10), over real DDS:
every request ends with one done chunk and a status, capsules of earlier processes
restore without id collisions, engine names are out of reach, string limits hold."""

from __future__ import annotations

import time

from std_msgs.msg import String

from embodied_kv.msg import MemoryUpdate, TextChunk
from embodied_kv.srv import Reset, Rollback, Snapshot

EARLIER, EARLIER_ANSWERS = "earlier", 6  # written by conftest as an earlier process would
OK, REFUSED, CANCELLED = TextChunk.STATUS_OK, TextChunk.STATUS_REFUSED, TextChunk.STATUS_CANCELLED
BURST = 60


def answers_since(robot, since):
    return robot.requests(TextChunk.TASK_ANSWER, since)


def finals(robot, task, since):
    return {
        rid: chunks[-1]
        for rid, chunks in robot.requests(task, since).items()
        if chunks[-1].done
    }


def diagnostics(robot):
    robot.wait_until(lambda: robot.diagnostics is not None, "/diagnostics")
    return {s.name: {kv.key: kv.value for kv in s.values} for s in robot.diagnostics.status}


def test_rollback_to_an_earlier_process_capsule_keeps_the_loop_answering(robot):
    robot.observe(seed=0)
    errors = int(diagnostics(robot)["embodied_kv: engine"]["cycle_failures"])
    since = time.monotonic()
    done = robot.call("rollback", Rollback.Request(name=EARLIER))
    assert done.success, done.message
    for i in range(3):
        robot.ask(f"after the restart, question {i}?")

    def answered():
        done = [c for c in finals(robot, TextChunk.TASK_ANSWER, since).values()
                if c.status == OK and c.text_so_far]  # fmt: skip
        return len(done) >= 3 + EARLIER_ANSWERS

    # the earlier process's answers go on, the new questions get ids of their own
    robot.wait_until(answered, "the earlier answers and the new ones", 60.0)
    robot.wait_until(lambda: robot.diagnostics is not None, "/diagnostics")
    time.sleep(1.0)
    assert int(diagnostics(robot)["embodied_kv: engine"]["cycle_failures"]) == errors
    robot.wait_for_actions()
    assert robot.call("reset", Reset.Request()).success


def test_question_burst_gets_one_final_chunk_each_ok_or_refused(robot):
    robot.observe(seed=1)
    robot.wait_text_idle()
    since = time.monotonic()
    for i in range(BURST):
        robot.ask(f"burst question {i}?")
    robot.wait_until(
        lambda: len(finals(robot, TextChunk.TASK_ANSWER, since)) >= BURST,
        f"{BURST} final answer chunks",
        60.0,
    )
    final = finals(robot, TextChunk.TASK_ANSWER, since)
    statuses = [c.status for c in final.values()]
    assert set(statuses) <= {OK, REFUSED}, statuses
    refused = [c for c in final.values() if c.status == REFUSED]
    assert refused and all("max_pending" in c.reason and c.text_so_far == "" for c in refused)
    assert all(c.text_so_far for c in final.values() if c.status == OK)
    lang = diagnostics(robot)["embodied_kv: language"]
    assert int(lang["refused_queue_full"]) >= len(refused)


def test_answers_in_flight_at_a_reset_end_cancelled_and_memory_is_emptied(robot):
    robot.observe(seed=2)
    robot.publish("memory", MemoryUpdate(segment_id="cup", operation=MemoryUpdate.OP_ADD,
                                         text="on the shelf"))  # fmt: skip
    robot.wait_text_idle()  # after this, every answer seen is this test's
    since = time.monotonic()
    robot.ask("describe everything you can see in great detail?")
    robot.wait_until(lambda: answers_since(robot, since), "the answer to start")
    assert robot.call("reset", Reset.Request()).success
    robot.wait_until(
        lambda: any(c.status == CANCELLED for c in finals(robot, TextChunk.TASK_ANSWER, since)
                    .values()),  # fmt: skip
        "a cancelled final chunk",
    )
    (final,) = finals(robot, TextChunk.TASK_ANSWER, since).values()
    assert final.status == CANCELLED and "restored to 'episode_start'" in final.reason
    robot.publish("plan_request", String(data="tidy up"))  # the reset emptied the memory
    robot.wait_until(lambda: "goal 'tidy up' over 0 memory segments" in robot.robot.log(),
                     "a plan over the emptied memory")  # fmt: skip


def test_plan_that_cannot_fit_is_refused_with_a_reason(robot):
    robot.call("reset", Reset.Request())
    robot.wait_text_idle()
    for i in range(4):
        fact = MemoryUpdate(segment_id=f"fact-{i}", operation=MemoryUpdate.OP_ADD, text="z" * 107)
        robot.publish("memory", fact)
    time.sleep(0.3)
    since = time.monotonic()
    robot.publish("plan_request", String(data="put every block in the bowl"))
    robot.wait_until(lambda: finals(robot, TextChunk.TASK_PLAN, since), "the plan's final chunk")
    (final,) = finals(robot, TextChunk.TASK_PLAN, since).values()
    assert final.status == REFUSED and "does not fit" in final.reason
    assert robot.call("reset", Reset.Request()).success  # leaves the memory empty


def test_engine_capsules_are_out_of_reach_and_steps_stay_in_the_episode(robot):
    for name, words in (("episode_start", "reserved"), ("auto-1", "reserved"),
                        ("abc\n", "bad capsule name")):  # fmt: skip
        response = robot.call("snapshot", Snapshot.Request(name=name, tier=0, pin=False))
        assert not response.success and words in response.message, response.message
    assert robot.call("reset", Reset.Request()).success
    refused = robot.call("rollback", Rollback.Request(steps_back=7))
    assert not refused.success and "boundaries kept in this timeline" in refused.message
    time.sleep(0.6)
    since = time.monotonic()
    assert robot.call("rollback", Rollback.Request(steps_back=1)).success
    robot.wait_until(lambda: [m for t, m in robot.chunks if t >= since], "a chunk")
    frame = int(next(m for t, m in robot.chunks if t >= since).header.frame_id)
    assert frame < 10  # still the new episode, not the discarded one


def test_oversized_strings_are_refused_before_use_and_logged_short(robot):
    big = "m" * 1_000_000
    robot.publish("plan_request", String(data=big))
    robot.publish("memory", MemoryUpdate(segment_id=big, operation=MemoryUpdate.OP_ADD, text="t"))
    robot.publish("question", String(data=big))
    for words in ("goal of 1000000 chars", "segment_id of 1000000 chars",
                  "question of 1000000 chars"):  # fmt: skip
        robot.wait_until(lambda w=words: w in robot.robot.log(), f"a logged {words!r}")
    assert max(len(line) for line in robot.robot.log().splitlines()) < 1000
    robot.wait_for_actions()
