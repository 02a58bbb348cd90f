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


def test_snapshot_then_rollback_replays_the_same_tokens(robot):
    robot.observe(seed=3)
    robot.wait_text_idle()
    before, since = set(robot.requests(TextChunk.TASK_ANSWER)), time.monotonic()
    robot.ask("describe the scene in detail")

    def first_new():
        ids = set(robot.requests(TextChunk.TASK_ANSWER, since)) - before
        return min(ids) if ids else None

    request_id = robot.wait_until(first_new, "the answer's first chunk")
    snap = robot.call("snapshot", Snapshot.Request(name="mid_answer", tier=TIER_HOST))
    assert snap.success, snap.message
    assert snap.bytes > 0 and snap.digest

    def final_text(after: float):
        chunks = robot.requests(TextChunk.TASK_ANSWER, after).get(request_id, [])
        return chunks[-1].text_so_far if chunks and chunks[-1].done else None

    original = robot.wait_until(lambda: final_text(since), "the answer to finish", 30.0)
    rolled = robot.call("rollback", Rollback.Request(name="mid_answer"))
    assert rolled.success, rolled.message
    after = time.monotonic()
    replayed = robot.wait_until(lambda: final_text(after), "the replayed answer", 30.0)
    assert replayed == original  # the same request, continued from the snapshot, same tokens
    resumed = robot.requests(TextChunk.TASK_ANSWER, after)[request_id]
    assert resumed[0].text_so_far != original, "rollback should resume mid-answer"

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
