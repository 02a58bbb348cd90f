"""`ros2 launch embodied_kv robot.launch.py`, run by launch_pytest.

launch, launch_ros and launch_pytest are not on PyPI: this runs on a ROS 2
workstation (after `colcon build` and `source install/setup.bash`) and is
skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

launch_pytest = pytest.importorskip(
    "launch_pytest",
    reason="launch_pytest is not importable (not on PyPI): runs on a ROS 2 workstation "
    "after `colcon build` and `source install/setup.bash`",
)

from launch import LaunchDescription  # noqa: E402
from launch_pytest.tools import process as process_tools  # noqa: E402
from launch_ros.actions import Node  # noqa: E402

LAUNCH_FILE = Path(__file__).resolve().parents[2] / "launch" / "robot.launch.py"


def _load_launch_description() -> LaunchDescription:
    spec = importlib.util.spec_from_file_location("robot_launch", LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate_launch_description()


ROBOT_LAUNCH = _load_launch_description()
ROBOT = next(e for e in ROBOT_LAUNCH.entities if isinstance(e, Node))


@launch_pytest.fixture
def launch_description():
    return LaunchDescription([*ROBOT_LAUNCH.entities, launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=launch_description)
def test_launch_brings_the_nodes_up(launch_context):
    process_tools.wait_for_output_sync(
        launch_context, ROBOT, lambda out: "nodes configured and active" in out, timeout=60
    )
