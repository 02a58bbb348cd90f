"""Capsule services as an RL episode manager uses them: reset, snapshot, rollback, list."""

from __future__ import annotations

import time

from embodied_kv.msg import TextChunk
from embodied_kv.srv import ListCapsules, Reset, Rollback, Snapshot

TIER_HOST, TIER_DISK = Snapshot.Request.TIER_HOST, Snapshot.Request.TIER_DISK


def test_three_episodes_with_reset_start_with_the_same_chunk(robot):
    firsts = []
    for episode in range(3):
        robot.observe(seed=7, instruction="stack the blocks")  # the same start every time
        response = robot.call("reset", Reset.Request())
        since = time.monotonic()
        assert response.success, response.message
        assert response.restore_ms >= 0.0
        firsts.append(robot.first_chunk_after(since))
        # the episode goes its own way: other frames, another instruction, a question
        robot.observe(seed=100 + episode, instruction=f"episode {episode}: wander off")
        robot.ask(f"where am I in episode {episode}?")
        time.sleep(0.5)
    assert firsts[1] == firsts[0]
    assert firsts[2] == firsts[0]


def test_rollback_never_replays_an_ended_answer_and_continues_a_live_one(robot):
    """Issue 35: one final chunk per request id across rollbacks (docs/requests.md)."""
    robot.observe(seed=3)
    robot.wait_text_idle()
    seen = set(robot.requests(TextChunk.TASK_ANSWER))

    def ask_and_snapshot(question: str, name: str) -> str:
        since = time.monotonic()
        robot.ask(question)

        def first_new():
            ids = set(robot.requests(TextChunk.TASK_ANSWER, since)) - seen
            return min(ids) if ids else None

        request_id = robot.wait_until(first_new, "the answer's first chunk")
        seen.add(request_id)
        snap = robot.call("snapshot", Snapshot.Request(name=name, tier=TIER_HOST))
        assert snap.success, snap.message
        assert snap.bytes > 0 and snap.digest
        return request_id

    def finals(request_id):
        chunks = robot.requests(TextChunk.TASK_ANSWER).get(request_id, [])
        return [c for c in chunks if c.done]

    ended = ask_and_snapshot("describe the scene in detail", "mid_answer")
    robot.wait_until(lambda: finals(ended), "the answer to finish", 30.0)
    rolled = robot.call("rollback", Rollback.Request(name="mid_answer"))
    assert rolled.success, rolled.message
    after = time.monotonic()
    time.sleep(2.0)  # 20 engine cycles: a replay would be streaming by now
    assert ended not in robot.requests(TextChunk.TASK_ANSWER, after)
    assert len(finals(ended)) == 1

    live = ask_and_snapshot("and now describe the table in detail", "mid_answer_2")
    rolled = robot.call("rollback", Rollback.Request(name="mid_answer_2"))  # still decoding
    assert rolled.success, rolled.message
    robot.wait_until(lambda: finals(live), "the continued answer to finish", 30.0)
    time.sleep(1.0)
    (final,) = finals(live)
    assert final.status == TextChunk.STATUS_OK and final.text_so_far

    steps = robot.call("rollback", Rollback.Request(steps_back=1))
    assert steps.success, steps.message


def test_list_capsules_reports_what_exists(robot):
    disk = robot.call("snapshot", Snapshot.Request(name="on_disk", tier=TIER_DISK))
    assert disk.success, disk.message
    listing = robot.call("list_capsules", ListCapsules.Request())
    assert listing.success, listing.message
    caps = dict(zip(listing.names, zip(listing.tiers, listing.bytes, listing.pinned,
                                       listing.digests, strict=True), strict=True))  # fmt: skip
    assert caps["episode_start"][2] is True  # pinned: what reset restores
    assert caps["on_disk"][0] == TIER_DISK and caps["on_disk"][1] == disk.bytes
    assert caps["on_disk"][3] == disk.digest
    assert (robot.robot.disk / "on_disk.safetensors").is_file()
    assert "foreign" in caps  # found on disk at start; restoring it is refused (test_bad_input)
