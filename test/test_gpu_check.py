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

from embodied_kv import gpu_check
from embodied_kv.bench import action_profile, mechanisms
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


def test_mechanisms_profile_dry_run_passes_on_the_cpu(tmp_path):
    """`make gpu-check-mechanisms`'s benches, at --preset tiny on the CPU (graphs in
    emulation): every bench runs and writes every field the GPU run promises."""
    proc = subprocess.run(
        [sys.executable, "-m", "embodied_kv.cli", "gpu-check", "--profile", "mechanisms",
         "--dry", "--out", str(tmp_path)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    assert out.name.endswith("-dry")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"] == "mechanisms" and summary["dry"] is True
    assert sorted(summary["steps"]) == sorted(b.name for b in mechanisms.PROFILE)
    for name, step in summary["steps"].items():
        assert step["returncode"] == 0 and step["fields_missing"] is None, (name, step)
        assert "--preset tiny --device cpu" in step["command"]
        assert step["hf_compiled"].startswith("compiled HF baselines skipped")
    keep = json.loads((out / "keep.json").read_text())
    graphs = {r["method"]: r for r in keep["rows"]}["keep-graphs"]
    assert graphs["captures"] >= 1 and graphs["host_work"]["prefill"]["graph_replays"] == 1


def test_mechanisms_profile_fits_the_window_and_its_gpu_arguments_parse(monkeypatch):
    """The GPU run's arguments are the ones the dry run exercised, at pi05 on CUDA, each
    accepted by its bench's own parser (a typo would cost the GPU session a bench)."""
    from embodied_kv import cli
    from embodied_kv.bench import harness

    assert mechanisms.GPU_BUDGET_S <= 8 * 60 - 60  # a minute for startup and env
    parsed = {}

    class Parsed(Exception):
        pass

    def parse_only(p, argv):
        parsed[p.prog] = p.parse_args(list(argv))  # unknown arguments: SystemExit
        raise Parsed

    monkeypatch.setattr(harness, "parse", parse_only)
    for b in mechanisms.PROFILE:
        cmd = mechanisms.command(b, "python", Path("/results"), dry=False)
        assert cmd[:6] == ["python", "-m", "embodied_kv.cli", "bench", b.name, "--preset"]
        assert cmd[6:9] == ["pi05", "--device", "cuda"]
        with pytest.raises(Parsed):
            cli.main(cmd[3:])
        args = parsed[f"embodied-kv bench {b.name}"]
        assert args.preset == "pi05" and args.device == "cuda"
    assert len(parsed) == len(mechanisms.PROFILE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: it would run")
def test_make_gpu_check_mechanisms_without_cuda_points_at_the_dry_run():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["make", "-s", "gpu-check-mechanisms"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpu-check:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "--dry" in lines[0]


def test_dry_runs_a_budgeted_profile_not_the_full_one(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry", "--profile", "full"])
    assert "--profile action|mechanisms" in capsys.readouterr().err


def test_action_profile_dry_run_passes_on_the_cpu(tmp_path):
    """`make gpu-check`'s steps at --preset tiny on the CPU: latency with its breakdown,
    kernel table and the LeRobot peer (not importable here: the JSON says why), the Triton
    kernels compiled for sm_90; the GPU-only steps are listed as skipped."""
    proc = subprocess.run(
        [sys.executable, "-m", "embodied_kv.cli", "gpu-check", "--dry", "--out", str(tmp_path)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"] == "action" and summary["dry"] is True
    steps = summary["steps"]
    assert sorted(steps) == sorted(s.name for s in action_profile.PROFILE if not s.on_request)
    for name in ("latency", "triton_kernels", "kernel_sweep"):
        assert steps[name]["returncode"] == 0 and steps[name]["fields_missing"] is None, steps
    assert steps["cuda_tests"]["skipped"]
    latency = json.loads((out / "latency.json").read_text())
    assert latency["peer"]["unavailable"] and latency["rows"][0]["kernels"]["rows"]
    kernels = json.loads((out / "triton_kernels.json").read_text())
    assert kernels and all(k["spill_stores"] == 0 for k in kernels)


def test_action_profile_fits_the_window_and_its_gpu_arguments_parse(monkeypatch):
    """The GPU run's bench arguments parse at pi05 on CUDA (a typo would cost the GPU
    session its measurement); its tests exist; its budgets fit 8 minutes with the start."""
    from embodied_kv import cli
    from embodied_kv.bench import harness

    assert action_profile.GPU_BUDGET_S <= 8 * 60
    assert all((ROOT / t).is_file() for t in action_profile.CUDA_TESTS)
    parsed = []

    class Parsed(Exception):
        pass

    def parse_only(p, argv):
        parsed.append(p.parse_args(list(argv)))  # unknown arguments: SystemExit
        raise Parsed

    monkeypatch.setattr(harness, "parse", parse_only)
    for step in action_profile.PROFILE:
        cmd = action_profile.command(step, "python", Path("/results"), dry=False)
        if cmd[1:4] != ["-m", "embodied_kv.cli", "bench"]:
            continue
        with pytest.raises(Parsed):
            cli.main(cmd[3:])
        assert parsed[-1].preset == "pi05" and parsed[-1].device == "cuda"
        assert getattr(parsed[-1], "peer", None) == ("lerobot" if step.peer else None)
    assert len(parsed) == 3  # latency, precision, LeRobot compiled


def test_peer_steps_get_the_wheels_folder_or_are_skipped(monkeypatch):
    monkeypatch.delenv("EMBODIED_KV_PEER_SITE", raising=False)
    assert gpu_check.peer_env() is None
    monkeypatch.setenv("EMBODIED_KV_PEER_SITE", "/tmp/site")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:/elsewhere")
    path = gpu_check.peer_env()["PYTHONPATH"].split(":")
    assert path == [str(ROOT), "/tmp/site", "/elsewhere"]  # the repository first, once
