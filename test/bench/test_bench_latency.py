"""`bench latency` runs end to end on the tiny preset, with its --breakdown pass."""

import json

import pytest

from embodied_kv.bench import latency, latency_breakdown
from embodied_kv.model.config import get_preset


def test_bench_latency_breakdown_json(tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--repeats", "2", "--breakdown"]
    assert latency.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and result["graph_mode"] == "emulate"
    rows = result["rows"]
    assert [r["cameras"] for r in rows] == list(range(1, get_preset("tiny").num_cameras + 1))
    for r in rows:
        assert r["graphs_ms"]["median"] > 0 and r["eager_ms"]["median"] > 0
        assert r["limit_ms"] is None and r["graphs_over_limit"] is None  # tiny on a CPU
        parts = r["breakdown_ms"]
        assert list(parts) == list(latency_breakdown.REGIONS)
        assert all(v >= 0 for v in parts.values()), parts
        assert parts["vision"] > 0 and parts["vision"] <= parts["embed_prefix"]
        timed = sum(parts[k] for k in latency_breakdown.SUMMED)
        # the regions lie inside the action of the same runs (medians of each: a margin);
        # not against the headline rounds, which another load on the machine may have sped
        # or slowed (it failed 279 vs 117 ms x 1.5 beside a training run)
        assert 0 < timed <= r["breakdown_action_ms"] * 1.25
        assert r["breakdown_action_ms"] > 0
    text = capsys.readouterr().out
    assert "host/other" in text and "embed_prefix" in text


def test_timed_methods_restores_the_originals():
    class Thing:
        def work(self, x):
            return x + 1

        def fail(self):
            raise RuntimeError("boom")

    thing, spent = Thing(), {}
    own = thing.fail  # an instance attribute already: it comes back as it was
    thing.fail = own
    where = {"work": (thing, "work"), "fail": (thing, "fail")}
    ticks = iter(range(100))
    with pytest.raises(RuntimeError):
        with latency_breakdown.timed_methods(where, lambda: next(ticks) / 1e3, spent):
            assert thing.work(1) == 2
            thing.fail()
    assert spent == {"work": 1.0, "fail": 1.0}  # a failing call still counts its time
    assert "work" not in vars(thing) and thing.work(1) == 2
    assert vars(thing)["fail"] is own
