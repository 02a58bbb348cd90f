"""Every attention and norm kernel configuration pi05 uses compiles for sm_90, no spills.

No GPU here: `triton.compile` targets sm_90 offline with the ptxas that ships in the triton
wheel (kernels/offline_compile.py). It runs in a child process because this session imports
triton under TRITON_INTERPRET=1 (test/conftest.py), where kernels cannot be compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import embodied_kv.kernels.triton_base as tb

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(tb.triton is None, reason="triton is not installed")
def test_pi05_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default; silences its warning
    report = tmp_path / "sm90.json"
    proc = subprocess.run(
        [sys.executable, "-m", "embodied_kv.kernels.offline_compile", "--json", str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    print(proc.stdout)  # the table: registers, spills, shared memory per configuration
    assert report.exists(), proc.stderr[-4000:]
    rows = json.loads(report.read_text())
    kernels = {r["name"].split()[0] for r in rows}
    want = {"splitk_partial", "splitk_reduce", "prefill_tile", "rms_norm", "rope"}
    want |= {"expert_attention", "expert_attention_rope", "expert_reduce", "gelu_gate"}
    want |= {"expert_attention_queue", "expert_attention_queue_rope"}  # the default
    want |= {"expert_layer_step"}  # the fused layer-step as one persistent launch
    want |= {"attn_stats"}
    want |= {"norm_qkv_rope", "norm_gate_up", "linear_gated_residual", "add_layer_norm"}
    want |= {"gated_rms_norm", "add_rms_norm", "flow_action_in", "flow_euler_out", "rope_store"}
    want |= {"prefill_reduce"}
    want |= {"l2_prefetch"}  # both GPU modes: per line and bulk
    assert kernels == want, kernels
    assert {r["arch"] for r in rows} == {90}
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"spills: {r}"
        assert 0 < r["registers"] <= 255
        assert r["shared_bytes"] <= 227 * 1024, f"over sm_90's shared memory per block: {r}"
        # the prefetch instructions survive compilation (an unused result must not drop them):
        # the prefetch kernel's and the persistent layer-step's items' (prefetch_share)
        assert r["prefetch"] == r["name"].startswith(("l2_prefetch", "expert_layer_step")), r
        if r["name"].startswith("prefill_tile") and "key_splits=1" in r["name"]:
            assert r["wgmma"], f"the 64-row prefill tile should use Hopper's warpgroup MMA: {r}"
    assert proc.returncode == 0, proc.stderr[-4000:]
