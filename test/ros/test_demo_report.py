"""The demo's report says per episode what the robot did: done, or the step limit and
the task stage it was stuck at (world/sim.py records it)."""

from __future__ import annotations

import numpy as np
import pytest

# the report reads TextChunk (embodied_kv.msg), which the ROS build generates
pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from embodied_kv.msg import TextChunk  # noqa: E402
from embodied_kv.ros.demo_report import Asked, Report  # noqa: E402
from embodied_kv.world.expert import expert_action  # noqa: E402
from embodied_kv.world.sim import WorldSim  # noqa: E402


def test_report_lists_each_episode_done_or_where_it_was_stuck():
    sim = WorldSim(seed=3, max_steps=30)
    while not sim.apply(expert_action(sim.scene, sim.task)[0]):
        pass  # episode 1: the expert finishes it
    a = sim.scene.arm
    for _ in range(30):  # episode 2: the arm holds still at the start pose
        sim.apply(np.array([a.x, a.y, a.z, -1.0]))
    lines = Report(target_hz=50.0, seconds=10.0, episodes=sim.results)._episodes()
    assert lines[0].startswith("task success: 1 of 2 episodes (50%)")
    assert lines[0].endswith("step limit at approach 1")
    assert lines[1].startswith("  episode 1 ") and ": done after" in lines[1]
    assert lines[2] == f"  episode 2 {sim.results[1].instruction!r}: step limit, stuck at " \
                       "approach after 30 actions"


def test_a_plan_that_names_the_place_as_a_path_counts_as_right():
    def chunk(rid: str, task: int, text: str) -> TextChunk:
        return TextChunk(request_id=rid, task=task, text_so_far=text, done=True,
                         status=TextChunk.STATUS_OK)  # fmt: skip

    report = Report(target_hz=50.0, seconds=10.0)
    report.goals = [Asked("where is the green ball ?", "sink"),
                    Asked("where is the green box ?", "floor")]  # fmt: skip
    report.questions = [Asked("how many blue objects are there ?", "one")]
    report.text = {
        "plan-1@0": chunk("plan-1@0", TextChunk.TASK_PLAN, "in the green box on the sink"),
        "plan-2@0": chunk("plan-2@0", TextChunk.TASK_PLAN, "shelf"),
        "answer-1@0": chunk("answer-1@0", TextChunk.TASK_ANSWER, "in the one"),
    }
    lines = report._texts()
    assert any("'sink', right]" in x for x in lines)
    assert any("'floor', wrong]" in x for x in lines)
    assert any("'one', wrong]" in x for x in lines)  # answers: the word itself
    assert "  plans right: 1 of 2 asked" in lines


def test_report_says_how_chunks_joined_and_whether_rtc_guided_them():
    diag = {"chunk_switches": "12", "boundary_jump_max": "0.731", "boundary_jump_last": "0.100",
            "inference_delay_ticks": "3", "observation_age_ticks": "1", "rtc_enabled": "False"}
    (line,) = Report._joins(diag)
    assert line.startswith("chunk joins: 12 switches, largest jump 0.731 (last 0.100); chunk "
                           "lands 3 ticks after its observation, which was 1 ticks old")
    assert "real-time chunking" not in line
    diag |= {"rtc_enabled": "True", "rtc_guided_chunks": "11", "rtc_delay_ticks": "3"}
    assert Report._joins(diag)[0].endswith("; real-time chunking: 11 chunks guided, d = 3")
    diag["rtc_stale_observations"] = "2"
    assert Report._joins(diag)[0].endswith(", 2 chunks from a scene older than their "
                                           "instruction not held to")
    assert Report._joins({}) == []  # no diagnostics received
