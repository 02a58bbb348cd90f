"""bench/gemm_sweep.py: the action's GEMM shapes as the census counts them, every candidate
equal to an fp32 GEMM on irregular shapes, its dry run (what gpu-check runs on the CPU) and
the arguments its GPU step passes."""

import json

import pytest
import torch

from embodied_kv.bench import action_profile
from embodied_kv.bench import estimate_floor as ef
from embodied_kv.bench import gemm_sweep as gs


def test_pi05_shapes_are_the_actions_gemms():
    rows = ef.shapes("pi05")
    calls = {}
    for r in rows:
        calls[r["region"]] = calls.get(r["region"], 0) + r["calls"]
    # a layer's four GEMMs: 18 prefill layers, 27 SigLIP layers, 18 expert layers x 10 steps
    assert calls == {"prefill": 72, "prefill3": 72, "vision": 108, "expert": 720}
    by = {(r["region"], r["gemm"]): r for r in rows}
    assert (by["prefill", "qkv"]["m"], by["prefill3", "qkv"]["m"]) == (704, 960)  # buckets
    assert (by["prefill", "gate_up"]["n"], by["prefill", "down"]["k"]) == (32768, 16384)
    assert by["vision", "fc1"]["m"] == 512 and by["vision", "fc1"]["bias"]
    # the expert's weights, 34.6 MB a layer (issue 33's floor of a layer-step)
    per_layer = sum(2 * r["n"] * r["k"] for r in rows if r["region"] == "expert")
    assert per_layer == 34_603_008
    assert ef.expert_weights_ms() == pytest.approx(180 * per_layer / 4.8e12 * 1e3)


@pytest.mark.parametrize(
    "m,n,k,bias", [(37, 96, 80, False), (5, 64, 192, True), (130, 34, 70, True)]
)
def test_every_candidate_is_the_gemm(m, n, k, bias):
    s = dict(region="x", gemm="y", m=m, n=n, k=k, calls=1, bias=bias)
    (L,) = gs.layer_inputs(s, 1, torch.float32, "cpu")
    ref = torch.nn.functional.linear(L["x"].double(), L["w"].double(),
                                     None if L["b"] is None else L["b"].double())  # fmt: skip
    labels = []
    for label, make, library in gs.candidates(s):
        with gs.blas(library):
            out = make(L)()
        assert out.shape == (m, n), label
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        labels.append(label)
    want = {"linear", "cublaslt"} | ({"pad128"} if m % 128 else set())
    want |= {"split_n2"} if n % 2 == 0 else set()
    want |= {"split_k2"} if k >= 2 * n and k % 2 == 0 else set()
    assert set(labels) == want


def test_dry_run(tmp_path):
    path = tmp_path / "gemm_sweep.json"
    assert gs.main(["--dry", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert len(result["rows"]) == 16 and set(result["totals"]) == {
        "prefill", "prefill3", "vision", "expert"}  # fmt: skip
    for row in result["rows"]:
        assert row["candidates"] and all(c["ok"] for c in row["candidates"].values())
        assert row["estimate_us"] > 0
    assert any("split_k2" in r["candidates"] for r in result["rows"])


def test_the_gpu_steps_arguments_parse():
    (step,) = [s for s in action_profile.PROFILE if s.name == "gemm_sweep"]
    args = gs.parse(list(step.gpu[2:]))
    assert not args.dry and args.budget_s <= step.budget_s - 5 and args.json
