import argparse
import json

import pytest
import torch

from embodied_kv.bench import harness


def make_args(argv):
    p = argparse.ArgumentParser()
    harness.add_common_args(p)
    return harness.parse(p, argv)


def test_stats_median_and_spread():
    s = harness.Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.n) == (3.0, 5)
    assert s.p10 == pytest.approx(1.4) and s.p90 == pytest.approx(4.6)
    with pytest.raises(ValueError):
        harness.Stats.of([])


def test_interleave_rotates_order_and_counts_calls():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    samples = harness.interleave(fns, "cpu", warmup=1, repeats=3)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in samples.values() for t in v)
    with pytest.raises(ValueError, match="repeats=0"):
        harness.interleave(fns, "cpu", repeats=0)


def test_ratio_is_paired_per_round():
    assert harness.ratio([2.0, 10.0, 4.0], [1.0, 10.0, 1.0]) == 2.0
    assert harness.ratio([2.0, 4.0], [1.0]) == 3.0


def test_environment_sets_threads_and_is_recorded(tmp_path):
    before = torch.get_num_threads()
    try:
        args = make_args(["--device", "cpu", "--threads", "1", "--json", str(tmp_path / "x.json")])
        env = harness.Environment.start(args, ["--threads", "1"])
        assert torch.get_num_threads() == 1
        out = harness.finish({"benchmark": "x"}, env, args.json)
    finally:
        torch.set_num_threads(before)
    written = json.loads((tmp_path / "x.json").read_text())
    assert written["benchmark"] == "x" and written["device"].startswith("CPU")
    e = written["environment"]
    assert e["threads"] == 1 and e["bench_argv"] == ["--threads", "1"]
    assert len(e["load_start"]) == 3 and len(e["load_end"]) == 3
    for name in ("torch", "triton", "transformers", "python"):
        assert e["versions"][name]
    assert e["command"] and e["wall_s"] >= 0 and out["environment"] == e


def test_common_checks_refuse_bad_input(capsys):
    with pytest.raises(SystemExit):
        make_args(["--threads", "0"])
    with pytest.raises(SystemExit):
        make_args(["--preset", "pi05", "--device", "cpu"])
    assert "--allow-cpu-pi05" in capsys.readouterr().err
