"""The robot process as users run it: a separate process, probed over DDS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROS_SKIP_REASON = "rclpy is not importable (no ROS 2 here; `make test` installs it into .venv)"
pytest.importorskip("rclpy", reason=ROS_SKIP_REASON)

from lifecycle_msgs.msg import State  # noqa: E402
from lifecycle_msgs.srv import GetState  # noqa: E402

from embodied_kv.ros.container import NODE_CLASSES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 30.0  # interpreter start + rclpy import on a busy 2-core machine
EXIT_TIMEOUT_S = 20.0


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


def test_container_brings_every_node_up_and_down_on_sigint(ros):
    # A namespace remap also proves ROS arguments reach every node of the process.
    process = python(
        "-m", "embodied_kv.ros.container", "--ros-args", "-r", f"__ns:={ros.namespace}"
    )
    try:
        caller = ros.participant().node("container_probe")
        for cls in NODE_CLASSES:
            client = caller.create_client(GetState, f"{ros.namespace}/{cls.NAME}/get_state")

            def is_active(client=client) -> bool:
                return ros.call(client, GetState.Request()).current_state.id == (
                    State.PRIMARY_STATE_ACTIVE
                )

            ros.wait_until(is_active, f"{cls.NAME} active", STARTUP_TIMEOUT_S)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "5 nodes configured and active (preset=tiny)" in out
    for cls in NODE_CLASSES:
        assert f"{cls.NAME}]: cleaned up" in err  # logger name: [<namespace>.<node>]


def test_cli_demo_runs_for_the_given_time_and_exits():
    process = python("-m", "embodied_kv.cli", "demo", "--seconds", "0.5")
    out, err = process.communicate(timeout=STARTUP_TIMEOUT_S + EXIT_TIMEOUT_S)
    assert process.returncode == 0, err
    assert "configured and active (preset=tiny)" in out
    assert "demo finished after 0.5 s" in out


def test_container_rejects_a_missing_config_with_one_line(tmp_path):
    process = python("-m", "embodied_kv.ros.container", "--config", str(tmp_path / "none.yaml"))
    out, err = process.communicate(timeout=STARTUP_TIMEOUT_S)
    assert process.returncode == 2
    assert "cannot read config" in err
