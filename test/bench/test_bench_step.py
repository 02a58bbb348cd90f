"""`bench step` runs end to end on the tiny preset and reports the agreed JSON fields."""

import json

import pytest

from embodied_kv.bench import step


def test_bench_step_json(tmp_path, capsys):
    out = tmp_path / "step.json"
    # --smoke: the smallest sweep (the real --quick sweep is the same code, more sizes)
    assert (
        step.main(["--preset", "tiny", "--quick", "--smoke", "--device", "cpu", "--json", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    for field in ("device", "preset", "date", "rows", "speedup_decode_vs_hf", "exact"):
        assert field in result, field
    assert result["preset"] == "tiny" and result["dtype"] == "float32"
    assert result["device"].startswith("CPU")
    assert result["exact"] is True
    kinds = {r["kind"] for r in result["rows"]}
    assert kinds == {"prefill", "decode", "text", "denoise"}
    for r in result["rows"]:
        assert r["ours_ms"] > 0 and r["hf_ms"] > 0
        assert r["speedup"] == pytest.approx(r["hf_ms"] / r["ours_ms"])
    decode = [r for r in result["rows"] if r["kind"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 4]
    assert all(r["tokens_equal_hf"] and r["batched_equals_one_by_one"] for r in decode)
    assert result["speedup_decode_vs_hf"] == decode[-1]["speedup"]
    assert max(r["max_abs_logit_diff"] for r in result["rows"] if r["kind"] == "prefill") < 1e-4
    assert next(r for r in result["rows"] if r["kind"] == "denoise")["max_abs_action_diff"] < 1e-5
    assert "HF/ours" in capsys.readouterr().out


def test_pi05_on_cpu_is_refused_without_the_flag(capsys):
    with pytest.raises(SystemExit) as err:
        step.parse(["--preset", "pi05", "--device", "cpu"])
    assert err.value.code == 2
    assert "--allow-cpu-pi05" in capsys.readouterr().err
    args = step.parse(["--preset", "pi05", "--device", "cpu", "--allow-cpu-pi05"])
    assert args.allow_cpu_pi05
