"""`action_mode: ar`: the robot process decodes action tokens pipelined across frames
(ActionFlow) and still publishes `action` at the configured rate, measured from this
process, while questions decode in the same packed step."""

from __future__ import annotations

import numpy as np

RATE_HZ = 50.0
WINDOW_S = 6.0  # as test_actions.py: one scheduling stall of a busy machine averages out
TOLERANCE = 0.05  # as test_actions.py


def test_ar_mode_holds_the_rate_and_publishes_decoded_chunks(ar_robot):
    robot = ar_robot
    robot.observe(seed=0)
    robot.wait_for_actions()
    robot.wait_until(lambda: len(robot.chunks) > 2, "decoded action chunks")
    start, end, asked = robot.ask_for(WINDOW_S)
    summary = robot.actions.summary(since=start, until=end)
    print(f"\nar mode, action stream over {WINDOW_S:g} s with {asked} questions: "
          f"{summary.line(RATE_HZ)}")  # fmt: skip
    assert abs(summary.rate_hz - RATE_HZ) <= TOLERANCE * RATE_HZ, summary
    assert summary.count >= (WINDOW_S - 0.5) * RATE_HZ * (1 - TOLERANCE)
    chunks = [m for t, m in robot.chunks if start <= t <= end]
    assert len(chunks) >= WINDOW_S * RATE_HZ / 5 * 0.8  # one action leaves per cycle
    for chunk in chunks:
        assert len(chunk.points) == 4  # ar.horizon
        assert all(len(p.positions) == 8 for p in chunk.points)
        steps = [p.time_from_start.nanosec / 1e9 + p.time_from_start.sec for p in chunk.points]
        assert np.allclose(np.diff(steps), 1.0 / RATE_HZ)
    frames = [int(c.header.frame_id) for c in chunks]
    assert frames == sorted(frames)  # actions leave in the order of their observations


def test_ar_mode_diagnostics_count_the_decoded_actions(ar_robot):
    ar_robot.wait_until(lambda: ar_robot.diagnostics is not None, "/diagnostics")
    values = lambda: {  # noqa: E731
        kv.key: kv.value
        for s in ar_robot.diagnostics.status
        if s.name == "embodied_kv: engine"
        for kv in s.values
    }
    ar_robot.wait_until(lambda: int(values().get("actions_decoded", 0)) > 0, "decoded actions")
    engine = values()
    assert engine["action_mode"] == "ar" and engine["action_tokens"] == "fast"
    assert int(engine["pipeline_depth_k"]) == 12
    assert 0 <= int(engine["actions_invalid"]) <= int(engine["actions_decoded"])
