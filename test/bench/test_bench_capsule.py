import json

from embodied_kv.bench.capsule import main


def test_capsule_quick_is_token_exact_and_faster_than_cold(tmp_path):
    out = tmp_path / "capsule.json"
    assert main(["--preset", "tiny", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"] and r["preset"] == "tiny" and r["token_exact"] is True
    for row in r["rows"]:
        for key in (
            "prefix_len",
            "cold_ms",
            "restore_ms",
            "speedup",
            "snapshot_ms",
            "bytes",
            "token_exact",
        ):
            assert key in row
        assert row["token_exact"] is True
    assert r["rows"][-1]["prefix_len"] >= 2048
    assert r["rows"][-1]["speedup"] > 1.0  # the > 5x goal lives in the benchmark's output
    assert (tmp_path / "capsule.png").exists()
