"""The robot process as users run it, from the command line. The robot's topics and
services are tested in test/ros/robot against one shared robot process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROS_SKIP_REASON = "rclpy is not importable (no ROS 2 here; `make test` installs it into .venv)"
pytest.importorskip("rclpy", reason=ROS_SKIP_REASON)


ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0  # interpreter start + torch and rclpy imports on a busy 2-core machine
EXIT_TIMEOUT_S = 20.0
DEMO_TIMEOUT_S = 60.0  # 6 s of episode + shutdown, on a loaded 2-core machine


def python(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_demo_plays_its_episode_and_prints_the_report():
    # What `make demo` runs, shortened; the robot process of the demo is its own.
    process = python("-m", "embodied_kv.cli", "demo", "--seconds", "6")
    out, err = process.communicate(timeout=STARTUP_TIMEOUT_S + DEMO_TIMEOUT_S)
    assert process.returncode == 0, out + err
    assert "5 nodes configured and active (preset=world)" in out
    for line in ("Hz (target 50); inter-arrival p50", "jitter p50", "deadline misses",
                 "tokens/s", "[answer-1]", "[plan-1]", "reset: round trip", "task success: ",
                 "[true: ", "answers right: ", "plans right: ",
                 "robot process exited with status 0"):  # fmt: skip
        assert line in out, out
    # the simulated arm applies the actions: an episode ended, or the running one moved
    assert re.search(r"task success: \d+ of ([1-9]\d* episodes|0 episodes; one more running "
                     r"\([1-9])", out), out  # fmt: skip


def test_container_rejects_a_missing_config_with_one_line(tmp_path):
    process = python("-m", "embodied_kv.ros.container", "--config", str(tmp_path / "none.yaml"))
    out, err = process.communicate(timeout=STARTUP_TIMEOUT_S)
    assert process.returncode == 2
    assert "cannot read config" in err
