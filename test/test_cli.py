"""`embodied-kv` command line: dispatch and errors (no ROS needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from embodied_kv import cli

ROOT = Path(__file__).resolve().parents[1]


def test_bench_dispatches_to_the_modules_main(monkeypatch):
    calls = []
    module = types.ModuleType("embodied_kv.bench.toy_bench")
    module.main = lambda argv: calls.append(argv) or 3
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert cli.main(["bench", "toy-bench", "--steps", "2"]) == 3
    assert calls == [["--steps", "2"]]


def test_missing_bench_is_one_clear_error(capsys):
    assert cli.main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no_such_bench'" in err
    assert "available:" in err


@pytest.mark.parametrize("name", ["../etc", "a.b", ""])
def test_bench_name_must_be_a_module_name(capsys, name):
    assert cli.main(["bench", name]) == 2
    assert "not a benchmark name" in capsys.readouterr().err


def test_bench_without_main_is_reported(monkeypatch, capsys):
    module = types.ModuleType("embodied_kv.bench.no_main")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert cli.main(["bench", "no_main"]) == 2
    assert "has no main(argv)" in capsys.readouterr().err


def test_cli_works_without_rclpy():
    """A GPU machine without ROS: `bench` runs, `demo` says what is missing."""
    code = (
        "import sys; sys.modules['rclpy'] = None\n"  # makes `import rclpy` fail
        "from embodied_kv import cli\n"
        "assert cli.main(['bench', 'no_such_bench']) == 2\n"
        "sys.exit(cli.main(['demo', '--seconds', '0']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "needs ROS 2 (rclpy is not importable)" in result.stderr
