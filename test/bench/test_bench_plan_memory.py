"""`bench plan_memory` end to end on the shipped world model, shortened: plans through two
real engines (memory.mode keep at any size, and full) over the same facts and frames."""

import json

import pytest

from embodied_kv.bench import plan_memory


@pytest.mark.timeout(300)
def test_bench_plan_memory_json(tmp_path, capsys):
    out = tmp_path / "plan_memory.json"
    assert plan_memory.main(["--quick", "--queries", "4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "plan_memory" and r["queries"] == 4 and r["segments_max"] == 5
    assert r["keep_small_memory"] == 0  # keep_min_segments 0: KEEP read every memory
    for mode in plan_memory.MODES:
        m = r["modes"][mode]
        assert 0 <= m["one_hop"] <= 1 and 0 <= m["two_hop"] <= 1
        assert m["cold_ms"] > 0 and m["warm_ms"] > 0
    assert 0 <= r["same_answer"] <= 1
    lost = r["modes"]["full"]["two_hop"] - r["modes"]["keep"]["two_hop"]
    assert r["two_hop_lost"] == pytest.approx(lost)
    assert any("two_hop" in x for x in r["losses"]) == (lost > 0)
    text = capsys.readouterr().out
    assert "where KEEP loses" in text and "full recomputation's answer" in text


def test_bench_plan_memory_refuses_bad_arguments():
    for argv in (["--queries", "1"], ["--containers", "1"], ["--preset", "pi05"]):
        with pytest.raises(SystemExit):
            plan_memory.parse(argv)
