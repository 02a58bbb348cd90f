"""The action stream, measured by a subscriber in this process (the robot is another)."""

from __future__ import annotations

import numpy as np

from embodied_kv.msg import TextChunk

RATE_HZ = 50.0
WINDOW_S = 6.0  # >= 5 s of actions while language requests decode
TOLERANCE = 0.05  # the rate may be off by at most 5%


def test_actions_hold_the_rate_while_language_decodes(robot):
    robot.observe(seed=0)
    robot.wait_for_actions()
    start, end, asked = robot.ask_for(WINDOW_S)
    summary = robot.actions.summary(since=start, until=end)
    decoding = [m for t, m in robot.text if start <= t <= end and m.task == TextChunk.TASK_ANSWER]
    print(f"\naction stream over {WINDOW_S:g} s with {asked} questions: "
          f"{summary.line(RATE_HZ)}")  # fmt: skip
    assert len(decoding) >= asked, "language requests did not decode during the window"
    assert abs(summary.rate_hz - RATE_HZ) <= TOLERANCE * RATE_HZ, summary
    assert summary.count >= (WINDOW_S - 0.5) * RATE_HZ * (1 - TOLERANCE)


def test_every_chunk_covers_the_horizon_with_the_configured_joints(robot):
    robot.wait_until(lambda: len(robot.chunks) > 2, "action chunks")
    _, chunk = robot.chunks[-1]
    assert chunk.joint_names == [f"joint_{i}" for i in range(1, 8)] + ["gripper"]
    assert len(chunk.points) == 10  # tiny: action_horizon
    steps = [p.time_from_start.nanosec / 1e9 + p.time_from_start.sec for p in chunk.points]
    assert np.allclose(np.diff(steps), 1.0 / RATE_HZ)
    assert all(len(p.positions) == 8 for p in chunk.points)
    assert int(chunk.header.frame_id) >= 0  # the engine frame the chunk was computed from


def test_diagnostics_report_rate_misses_tokens_arena_and_capsules(robot):
    robot.wait_until(lambda: robot.diagnostics is not None, "/diagnostics")
    sections = {s.name: {kv.key: kv.value for kv in s.values} for s in robot.diagnostics.status}
    output = sections["embodied_kv: action output"]
    assert abs(float(output["rate_hz"]) - RATE_HZ) < 0.1 * RATE_HZ
    for key in ("jitter_p99_ms", "deadline_misses"):
        assert key in output
    assert "tokens_per_s" in sections["embodied_kv: engine"]
    engine = sections["embodied_kv: engine"]  # chunk boundaries and real-time chunking
    assert engine["rtc_enabled"] == "False" and int(engine["chunk_switches"]) >= 0
    assert {"boundary_jump_max", "boundary_jump_last", "inference_delay_ticks"} <= set(engine)
    assert engine["kernels_off"] == "" and "kernels_off_reasons" in engine  # CPU: no kernel
    assert engine["persistent_wait_timeouts"] == "0"
    assert int(sections["embodied_kv: kv arena"]["slots"]) == 8
    capsules = sections["embodied_kv: capsules"]
    assert {"gpu_bytes", "host_bytes", "disk_bytes"} <= set(capsules)
