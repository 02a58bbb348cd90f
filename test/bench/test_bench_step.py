"""`bench step` runs end to end on the tiny preset and reports the agreed JSON fields."""

import json

import pytest

from embodied_kv.bench import step
from embodied_kv.kernels.packed_attention import ROW_BUCKET

LANGUAGE = {"hf_eager_one_by_one", "hf_sdpa_batched", "hf_static_compiled"}


def test_bench_step_json(tmp_path, capsys):
    out = tmp_path / "step.json"
    # --smoke: the smallest sweep; --skip-compiled: no minute of torch.compile in the suite
    # (the compiled rows are still there, reported as skipped with the reason)
    argv = ["--preset", "tiny", "--quick", "--smoke", "--skip-compiled", "--json", str(out)]
    assert step.main([*argv, "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    for field in ("device", "preset", "date", "rows", "ratios", "exact", "environment"):
        assert field in result, field
    assert result["preset"] == "tiny" and result["dtype"] == "float32"
    assert result["clock"] == "wall"
    assert result["device"].startswith("CPU") and result["exact"] is True
    env = result["environment"]
    assert env["threads"] == 1 and env["versions"]["transformers"] and len(env["load_start"]) == 3
    rows = result["rows"]
    assert {r["kind"] for r in rows} == {"prefill", "decode", "text", "denoise"}
    for r in rows:
        assert r["ours_ms"] > 0 and r["ours"]["p10"] <= r["ours_ms"] <= r["ours"]["p90"]
        if r["speedup"] is None:
            assert r["unavailable"].startswith("skipped") and r["baseline_ms"] is None
        else:
            assert r["baseline_ms"] > 0 and r["speedup"] > 0
    decode = [r for r in rows if r["kind"] == "decode"]
    assert {(r["batch"], r["baseline"]) for r in decode} == {
        (b, name) for b in (1, 4) for name in LANGUAGE
    }
    assert all(r["batched_equals_one_by_one"] for r in decode)
    eager = [r for r in decode if r["baseline"] == "hf_eager_one_by_one"]
    assert all(r["token_agreement"] == 1.0 for r in eager)
    assert (
        result["decode_b1_vs_hf_sdpa_one_request"] == result["ratios"]["decode/1/hf_sdpa_batched"]
    )
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert {r["baseline"] for r in prefill} == {"hf_eager", "hf_sdpa"}
    assert max(r["max_abs_logit_diff"] for r in prefill) < 1e-4
    denoise = {r["baseline"]: r for r in rows if r["kind"] == "denoise"}
    assert set(denoise) == {"lerobot_eager", "openpi_compiled"}
    assert denoise["lerobot_eager"]["max_abs_action_diff"] < 1e-5
    inv = result["gemm_row_invariance"]
    assert inv["bucket_sizes_that_differ"] == [] and inv["row_bucket"] == ROW_BUCKET
    assert "base/ours" in capsys.readouterr().out


def test_pi05_on_cpu_is_refused_without_the_flag(capsys):
    with pytest.raises(SystemExit) as err:
        step.parse(["--preset", "pi05", "--device", "cpu"])
    assert err.value.code == 2
    assert "--allow-cpu-pi05" in capsys.readouterr().err
    args = step.parse(["--preset", "pi05", "--device", "cpu", "--allow-cpu-pi05"])
    assert args.allow_cpu_pi05


def test_thread_clock_only_for_one_cpu_thread(capsys):
    """Thread CPU time measures the work of the thread that runs it: one CPU thread only."""
    assert step.parse(["--device", "cpu", "--clock", "thread"]).clock == "thread"
    for extra in (["--threads", "2"], ["--clock", "cycles"]):
        with pytest.raises(SystemExit) as err:
            step.parse(["--device", "cpu", "--clock", "thread", *extra])
        assert err.value.code == 2
