import json

from embodied_kv.bench.oxygen import main
from embodied_kv.bench.oxygen_modes import MODES


def test_oxygen_ablations_and_concurrent_processes_are_exact(tmp_path):
    out = tmp_path / "oxygen.json"
    assert main(["--preset", "tiny", "--quick", "--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("device", "preset", "speedup", "exact", "rows", "date", "ratios", "environment"):
        assert key in r
    assert r["exact"] is True  # every mode, the two processes included, wrote the same text
    (row,) = r["rows"]
    for mode in (*MODES, "concurrent"):
        m = row[mode]
        assert m["action_hz"] > 0 and m["tokens_per_s"] > 0 and m["cycle_ms"] > 0
        assert m["requests_timed"] > 0 and 0 < m["latency_ms_p50"] <= m["latency_ms_p99"]
        assert m["speedup_vs_isolated"] > 0
    assert row["isolated"]["speedup_vs_isolated"] == 1.0
    assert set(r["ratios"]) == {f"8x2/{m}" for m in (*MODES, "concurrent") if m != "isolated"}
    assert (tmp_path / "oxygen.png").stat().st_size > 10_000
