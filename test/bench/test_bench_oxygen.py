import json

from embodied_kv.bench.oxygen import main


def test_oxygen_quick_writes_json_and_plot_and_is_exact(tmp_path):
    out = tmp_path / "oxygen.json"
    assert main(["--preset", "tiny", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("device", "preset", "speedup", "exact", "rows", "date"):
        assert key in r
    for mode in ("unified", "isolated"):
        assert r[mode]["action_hz"] > 0 and r[mode]["tokens_per_s"] > 0
    assert r["exact"] is True
    assert r["speedup"] > 1.0  # the > 1.5x goal is the benchmark's, not a timed test's
    assert (tmp_path / "oxygen.png").stat().st_size > 10_000
