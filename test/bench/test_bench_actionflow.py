"""`bench actionflow` runs end to end on the tiny preset and reports ratios and latencies."""

import json

import pytest

from embodied_kv.bench import actionflow


def test_bench_actionflow_json(tmp_path, capsys):
    out = tmp_path / "actionflow.json"
    argv = ["--preset", "tiny", "--quick", "--smoke", "--device", "cpu", "--json", str(out)]
    assert actionflow.main(argv) == 0
    result = json.loads(out.read_text())
    for field in ("device", "preset", "date", "rows", "unified", "exact", "environment"):
        assert field in result, field
    assert result["exact"] is True
    assert result["environment"]["command"] and result["fps_vs_sequential_k7"] > 0
    assert {r["tokens"] for r in result["rows"]} == {"bins", "fast"}
    for r in result["rows"]:
        for name in ("sequential", "naive_pipe", "actionflow"):
            assert r[name]["actions_per_s"] > 0 and r[name]["latency_ms"] > 0
        # one round (--smoke): the median of per-round ratios is that round's ratio
        flow, seq = r["actionflow"]["actions_per_s"], r["sequential"]["actions_per_s"]
        assert r["fps_vs_sequential"] == pytest.approx(flow / seq)
    u = result["unified"]
    assert u["unified"]["tokens_per_s"] > 0 and u["separate"]["cycle_ms"] > 0
    assert "vs naive pipe" in capsys.readouterr().out
