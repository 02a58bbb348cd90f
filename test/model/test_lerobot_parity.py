"""Our network is LeRobot's PI05: LeRobot 0.6.1's own `PI05Policy`, the pinned release, run
on this CPU with our weights (through its `load_state_dict`), our prompt ids and our noise,
returns our action chunk to fp32 rounding, at pi0.5's widths with one layer, 2 and 3
cameras. Not a re-implementation: `scripts/lerobot_cpu_check.sh --agreement` installs the
real wheels into a side environment (LeRobot needs Python >= 3.12; its five lines of 3.12
syntax are rewritten to their 3.11 forms there) and runs `embodied_kv.bench.lerobot_peer`.
~2 minutes and ~10 GB of memory; the wheels come from PyPI (pip's cache after the first)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # fp32, two summation orders of the same network (measured: 1.9e-6)


@pytest.mark.skipif(shutil.which("python3.11") is None, reason="the side environment is "
                    "built with python3.11, as this project's machines have it")  # fmt: skip
def test_lerobot_pi05policy_gives_our_chunk(tmp_path):
    out = tmp_path / "agreement.json"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "lerobot_cpu_check.sh"), "--agreement", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["pinned"] == "0.6.1" and [r["cameras"] for r in result["rows"]] == [2, 3]
    for r in result["rows"]:
        assert r["max_abs_diff"] < TOLERANCE, r
        assert r["chunk_rms"] > 0.5  # a real chunk (the noise's scale), not zeros both sides
