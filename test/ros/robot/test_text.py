"""Streamed text: answers on `text`, memory-backed plans on `plan`."""

from __future__ import annotations

import time

from std_msgs.msg import String

from embodied_kv.msg import MemoryUpdate, TextChunk

GOAL = "put the cup in the bowl"
ADD, UPDATE = MemoryUpdate.OP_ADD, MemoryUpdate.OP_UPDATE


def new_request(robot, task: int, since: float, before: set[str]) -> str:
    def first_new():
        ids = set(robot.requests(task, since)) - before
        return min(ids) if ids else None

    return robot.wait_until(first_new, f"a new task-{task} request")


def finished(robot, task: int, request_id: str, since: float) -> list[TextChunk]:
    def done():
        chunks = robot.requests(task, since).get(request_id, [])
        return chunks if chunks and chunks[-1].done else None

    return robot.wait_until(done, f"the done chunk of {request_id}", 30.0)


def test_question_streams_text_chunks_ending_with_done(robot):
    robot.observe(seed=0)
    robot.wait_text_idle()
    before, since = set(robot.requests(TextChunk.TASK_ANSWER)), time.monotonic()
    robot.ask("what is on the table?")
    request_id = new_request(robot, TextChunk.TASK_ANSWER, since, before)
    chunks = finished(robot, TextChunk.TASK_ANSWER, request_id, since)
    assert len(chunks) > 1, "the answer should stream in several chunks"
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.new_text for c in chunks) == chunks[-1].text_so_far
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.text_so_far.startswith(a.text_so_far)
    assert chunks[-1].text_so_far


def test_plan_request_decodes_a_plan_from_the_memory(robot):
    robot.wait_text_idle()
    segments = {"object/cup": "red cup on the left", "object/bowl": "bowl in the middle"}
    for key, text in segments.items():
        robot.publish("memory", MemoryUpdate(segment_id=key, operation=ADD, text=text))
    robot.publish("memory", MemoryUpdate(segment_id="object/cup", operation=UPDATE, text="in bowl"))
    time.sleep(0.3)
    before, since = set(robot.requests(TextChunk.TASK_PLAN)), time.monotonic()
    robot.publish("plan_request", String(data=GOAL))
    request_id = new_request(robot, TextChunk.TASK_PLAN, since, before)
    chunks = finished(robot, TextChunk.TASK_PLAN, request_id, since)
    assert request_id.startswith("plan-") and chunks[-1].text_so_far
    assert all(c.task == TextChunk.TASK_PLAN for c in chunks)
    # the plan's prompt was the memory as text: the node says how many segments it read
    robot.wait_until(
        lambda: (
            f"plan request {request_id}: goal {GOAL!r} over 2 memory segments" in robot.robot.log()
        ),
        "the plan request's log line",
    )

    def memory_kv():  # KEEP, as this robot's config asks: the plan read cached blocks
        status = {s.name: {kv.key: kv.value for kv in s.values}
                  for s in robot.diagnostics.status} if robot.diagnostics else {}  # fmt: skip
        memory = status.get("embodied_kv: planner memory", {})
        return memory if memory.get("mode") == "keep" and int(memory["blocks"]) >= 1 else None

    robot.wait_until(memory_kv, "the planner memory's blocks on /diagnostics")
