"""`bench latency --peer lerobot` where LeRobot cannot run (this CPU's Python 3.11): the
reason is in the result and every other row runs; what the peer loads and what a GPU
machine is sent. The peer itself ran on this CPU in a side environment (Python 3.11 with
LeRobot's five Python 3.12 lines rewritten, docs/gpu.md): its chunk equalled ours within
1.4e-6 at pi0.5's widths, one layer."""

import importlib.util
import json
import subprocess
from pathlib import Path

from embodied_kv.bench import latency, lerobot_peer
from embodied_kv.model.config import get_preset

ROOT = Path(__file__).resolve().parents[2]
HAS_LEROBOT = importlib.util.find_spec("lerobot") is not None


def test_why_not_names_what_is_missing():
    assert "pi0.5's widths" in lerobot_peer.why_not(get_preset("tiny"))
    why = lerobot_peer.why_not(get_preset("pi05", 1, 1))
    if HAS_LEROBOT:  # a GPU machine with the carried wheels
        assert why is None or lerobot_peer.PINNED in why
    else:
        assert "not importable" in why and "Python >= 3.12" in why


def test_bench_latency_without_lerobot_says_why_and_runs(tmp_path, capsys):
    if HAS_LEROBOT:
        return  # the peer's rows are measured instead (GPU machine)
    out = tmp_path / "latency.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--repeats", "2"]
    assert latency.main([*argv, "--peer", "lerobot", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    peer = result["peer"]
    assert peer["pinned"] == lerobot_peer.PINNED and "pi0.5's widths" in peer["unavailable"]
    assert result["rows"] and all("lerobot_ms" not in r for r in result["rows"])
    assert "peer LeRobot 0.6.1: not measured" in capsys.readouterr().out


def test_peer_compile_needs_the_peer(capsys):
    try:
        latency.main(["--preset", "tiny", "--device", "cpu", "--peer-compile", "default"])
    except SystemExit as e:
        assert e.code == 2
    assert "--peer-compile needs --peer lerobot" in capsys.readouterr().err


def test_the_device_wheels_are_the_pinned_list():
    listed = subprocess.run([str(ROOT / "scripts" / "peer_wheels.sh"), "--list"],
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert listed == list(lerobot_peer.DEVICE_WHEELS)
    assert f"lerobot=={lerobot_peer.PINNED}" in listed
    assert all(w.count("==") == 1 for w in listed)
