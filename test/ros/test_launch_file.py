"""launch/robot.launch.py, checked without `launch` (not on PyPI): its shape.
The launch itself is tested in test_launch.py on a ROS 2 workstation."""

from __future__ import annotations

import ast
from pathlib import Path

LAUNCH_FILE = Path(__file__).resolve().parents[2] / "launch" / "robot.launch.py"


def test_launch_file_starts_the_robot_executable_with_config_and_preset():
    tree = ast.parse(LAUNCH_FILE.read_text(), str(LAUNCH_FILE))
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert {"embodied_kv", "robot", "config", "preset", "--config", "--preset"} <= strings
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "generate_launch_description" in functions
