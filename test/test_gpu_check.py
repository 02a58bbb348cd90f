"""`make gpu-check`: its refusal without CUDA, the results it writes, and the test suite's
behaviour on a GPU machine without ROS (the ROS tests skip with their reasons)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embodied_kv.gpu_check import environment, results_dir, write_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check would run")
def test_make_gpu_check_without_cuda_stops_with_one_line():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["make", "-s", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpu-check:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
    assert proc.stdout == ""  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check would run")
def test_gpu_check_flags_pass_through_make_and_the_cli():
    """`make gpu-check GPU_CHECK_ARGS="--skip-tests ..."` reaches gpu_check.py's own parser
    (the CLI's REMAINDER argument refused flags in front: 'unrecognized arguments')."""
    env = dict(os.environ, PYTHON=sys.executable)
    args = "GPU_CHECK_ARGS=--skip-tests --only latency,capsule --timeout 60 --bench-args=--quick"
    proc = subprocess.run(
        ["make", "-s", "gpu-check", args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr, proc.stderr
    assert "unrecognized arguments" not in proc.stderr and "usage:" not in proc.stderr


def test_environment_json_and_results_folder(tmp_path):
    env = environment("cpu")
    assert {"date", "device", "driver", "cuda", "torch", "triton", "python", "commit"} <= set(env)
    assert env["torch"] == torch.__version__ and env["driver"] is None
    out = results_dir(tmp_path, env)
    assert out.parent == tmp_path and re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+", out.name)
    write_json(out / "env.json", env)
    assert json.loads((out / "env.json").read_text()) == env
    named = results_dir(tmp_path, {**env, "device": "NVIDIA H100 80GB HBM3"})
    assert named.name.endswith("-nvidia-h100-80gb-hbm3")


BLOCK_ROS = """
import sys
from importlib.abc import MetaPathFinder
ROS = {"rclpy", "launch", "launch_ros", "launch_pytest", "std_msgs", "sensor_msgs",
       "lifecycle_msgs", "diagnostic_msgs", "trajectory_msgs", "builtin_interfaces",
       "rcl_interfaces", "ament_index_python", "cv_bridge"}
class NoRos(MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ROS or name in ("embodied_kv.msg", "embodied_kv.srv"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoRos())
"""


def test_ros_tests_skip_with_their_reason_where_rclpy_is_missing(tmp_path):
    """The GPU machine has no ROS: collecting test/ros there must skip, not error."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_ROS)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "test/ros"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not re.search(r"\d+ errors?\b", proc.stdout)  # no collection error
    assert proc.stdout.count("rclpy is not importable") >= 4
