"""scripts/train_world_gpu.sh, the one command of a GPU window, run tiny on the CPU: its
flags reach `train` (the recipe's grounding head, task states) and both evals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_world_gpu.sh"


def _run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable,
                                            "RESULTS": str(tmp_path), **env})  # fmt: skip


def test_the_gpu_script_trains_the_recipe_and_evaluates_both_action_modes(tmp_path):
    done = _run(tmp_path, DEVICE="cpu", MINUTES="0.04", WORKERS="1", SEED="5",
                EVAL_ARGS="--episodes 1 --questions 3 --memory 2 --sanity 0 --no-oracle")
    assert done.returncode == 0, done.stderr[-2000:]
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log and log[0]["ground"] > 0 and log[0]["flow"] == log[0]["flow_real"]
    for mode in ("flow", "ar"):
        result = json.loads((tmp_path / f"eval_{mode}.json").read_text())
        assert result["config"]["action_mode"] == mode and "trained" in result["rows"]
    assert "device cpu, 0.04 min" in (tmp_path / "summary.txt").read_text()


def test_without_cuda_it_stops_at_once(tmp_path):
    if torch.cuda.is_available():
        return  # the message is for machines without one
    done = _run(tmp_path / "r")
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not (tmp_path / "r").exists()
