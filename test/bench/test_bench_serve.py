"""`bench serve` end to end, shortened: real servers on 127.0.0.1, real client processes."""

import json

import pytest

from embodied_kv.bench import serve


@pytest.mark.timeout(240)
def test_bench_serve_json(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["--quick", "--rounds", "1", "--requests", "3", "--seconds", "0.5"]
    assert serve.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "serve" and r["preset"] == "tiny"
    assert r["environment"]["threads"] == 1
    for name in ("ours", "openpi"):
        o = r["overhead"][name]
        assert o["requests"] == 3 and o["rtt_ms"] > o["action_latency_ms"] > 0
        # the server's own msgpack, timed in place, is what the overhead leaves out
        assert 0 < o["server_msgpack_in_place_ms"] < o["rtt_ms"] - o["action_latency_ms"]
    assert r["overhead"]["direct"]["requests"] == 3
    assert r["serialisation_ms"]["server"] > 0 and r["serialisation_ms"]["client"] > 0
    rows = {(t["design"], t["clients"]) for t in r["throughput"]}
    assert {("ours", n) for n in serve.CLIENTS} <= rows
    assert ("openpi, a server per client", 1) not in rows  # the same as one server
    for t in r["throughput"]:
        assert t["chunks_per_s"] > 0
        assert t["actions_per_s"] == pytest.approx(t["chunks_per_s"] * r["action_horizon"])
    lost = [t for t in r["throughput"] if t["ours_over_this"] < 1.0]
    assert len([x for x in r["losses"] if "clients" in x]) == len(lost)
    assert r["overhead_goal_met"] == (r["overhead"]["ours"]["server_overhead_ms"] <= 0.5)
    text = capsys.readouterr().out
    assert "server overhead" in text and "where we lose" in text
