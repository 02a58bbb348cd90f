import argparse
import json

import numpy as np

from embodied_kv.bench.keep import fact_tokens, main, run_segments
from embodied_kv.bench.keep_stream import Stream, answers, parse, shape
from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model

METHODS = ["full", "prefix", "reuse", "cacheblend", "keep", "keep-no-static", "keep-one-hop",
           "keep-no-balance"]  # fmt: skip


def test_keep_bench_rows_are_complete_and_the_exact_methods_agree(tmp_path, capsys):
    out = tmp_path / "keep.json"
    argv = ["--quick", "--segments", "10,20", "--requests", "2", "--weights", ""]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["benchmark"] == "keep" and r["weights"] == "random world" and r["device"]
    assert [(row["segments"], row["method"]) for row in r["rows"]] == [
        (n, m) for n in (10, 20) for m in METHODS
    ]
    for row in r["rows"]:
        assert row["ttft_ms"] > 0 and row["speedup_vs_full"] > 0 and 0 <= row["agree"] <= 1
        assert 0 < row["compute_share"] <= 1
        if row["method"] in ("full", "prefix"):  # exact: the same tokens as full recomputation
            assert row["agree"] == 1.0 and row["same_answer"] == 1.0
        assert 0 <= row["same_answer"] <= 1
        if row["method"].startswith("keep"):
            active = row["active_per_layer"]
            assert active == sorted(active, reverse=True) and active[0] > active[-1]
    assert r["memory"]["20"]["static_groups"] >= 1  # the spared groups turned static
    assert "verdict: random weights" in r["verdict"] and r["verdict"] in capsys.readouterr().out


def test_streams_keep_their_size_and_answers_follow_the_latest_fact():
    stream = Stream.make(40, 3)
    assert sum(shape(40)) == 40 == len(stream.facts)
    for _ in range(30):
        key, text, group = stream.update()
        assert stream.facts[int(key.split("/")[1])] == text and parse(text)[0] == group
    place, holder = answers(["the red box is on the shelf .", "the blue key is in the red box .",
                             "the red box is on the sink ."])  # fmt: skip
    assert place == {"red box": "sink"} and holder == {"blue key": "red box"}
    query, truth = stream.query(2, stream.facts)
    assert query.startswith("where is the ") and truth


def test_the_verdict_quotes_the_paired_error_of_the_points_lost():
    from embodied_kv.bench.harness import paired_difference
    from embodied_kv.bench.keep import verdict

    full, keep = [True, True, False, False], [True, False, False, False]
    lost, se = paired_difference(full, keep)
    assert (lost, se) == (0.25, np.std([0, 1, 0, 0], ddof=1) / 2)
    assert paired_difference(full, full) == (0.0, 0.0)
    rows = [{"segments": 40, "method": m, "two_hop": v, "two_hop_se_vs_full": e,
             "speedup_vs_full": 1.0, "one_hop": 0.5, "one_hop_n": 100}
            for m, v, e in (("full", 0.5, 0.0), ("keep", 0.25, se), ("reuse", 0.1, 0.1),
                            ("cacheblend", 0.2, 0.1))]  # fmt: skip
    line = verdict(rows, trained=True)
    assert line.startswith("verdict: FAIL") and f"+25.0 ± {se * 100:.1f} SE points lost" in line
    # a KEEP above full recomputation has lost nothing (the bound is one-sided)
    rows[1]["two_hop"] = 0.54
    line = verdict(rows, trained=True)
    assert line.startswith("verdict: PASS") and "-4.0 ±" in line and "need <= 3: True" in line


def test_the_verdict_ranks_nothing_when_full_recomputation_guesses():
    """A model that answers one place for every query scores about a guess among the five
    places (step 6,000 of the kept run at 40 facts, 2026-11-25): no verdict on accuracy.
    The bar is two standard errors of a guess over the one-hop queries."""
    from embodied_kv.bench.keep import GUESS, reads_memory, verdict

    rows = [{"segments": 40, "method": m, "two_hop": v, "two_hop_se_vs_full": 0.02,
             "speedup_vs_full": 1.0, "one_hop": 0.28, "one_hop_n": 50}
            for m, v in (("full", 0.48), ("keep", 0.48), ("reuse", 0.44),
                         ("cacheblend", 0.44))]  # fmt: skip
    assert GUESS == 0.2 and reads_memory(rows[0]) == (False, 0.2 + 2 * (0.16 / 50) ** 0.5)
    line = verdict(rows, trained=True)
    assert line.startswith("verdict: INCONCLUSIVE") and "by the rule: PASS" in line
    rows[0]["one_hop"], rows[0]["one_hop_n"] = 0.26, 200  # 400 requests: the bar is 0.257
    assert reads_memory(rows[0])[0] and verdict(rows, trained=True).startswith("verdict: PASS")


def test_the_arena_holds_the_memory_in_a_byte_tokenizer_s_ids():
    """pi05's byte ids make a fact ~40 tokens, not the world words' 9: the arena was sized
    at 16 a segment and `bench keep --preset pi05` overflowed its slot on the H100
    (2026-11-23). A byte-id model (tiny) through every method at 10 segments."""
    model = build_model(get_preset("tiny"))
    assert model.cfg.tokenizer == "bytes" and fact_tokens(model) > 30
    args = argparse.Namespace(seed=0, window=10, requests=2, updates=2, graphs="auto",
                              keep_ratios=(0.5, 0.2))
    raw = run_segments(model, 10, args, "cpu")
    assert set(raw["methods"]) == set(METHODS)
    assert all(len(s["ttft"]) == 2 for s in raw["methods"].values())


def test_preset_pi05_means_pi05_shapes_not_the_shipped_world_model():
    """gpu-check runs `bench keep --preset pi05 --device cuda`: random pi05 weights (TTFT at
    pi05's shapes), never the shipped world model the tiny preset defaults to."""
    from embodied_kv.bench.keep import SHIPPED, default_weights

    assert default_weights("pi05", None) == ""
    assert default_weights("tiny", None) == (str(SHIPPED) if SHIPPED.is_file() else "")
    assert default_weights("tiny", "") == "" and default_weights("pi05", "w.st") == "w.st"


def test_the_graphed_rows_are_exact(tmp_path):
    """`full-graphs`, `prefix-graphs` and `keep-graphs` (on CUDA by default) run the graph code
    path on the CPU (`--graphs emulate`): the tokens of eager full recomputation and of
    eager KEEP; the verdict compares the faster KEEP with the faster full."""
    out = tmp_path / "keep.json"
    argv = ["--quick", "--segments", "10", "--requests", "2", "--weights", "", "--graphs",
            "emulate", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    rows = {row["method"]: row for row in r["rows"]}
    assert list(rows) == [METHODS[0], "full-graphs", METHODS[1], "prefix-graphs",
                          *METHODS[2:], "keep-graphs"]  # fmt: skip
    for exact in ("full-graphs", "prefix-graphs"):  # full recomputation's tokens, replayed
        assert rows[exact]["agree"] == 1.0 and rows[exact]["same_answer"] == 1.0
    assert rows["full-graphs"]["compute_share"] == 1.0
    assert rows["prefix-graphs"]["compute_share"] == rows["prefix"]["compute_share"]
    for key in ("agree", "same_answer", "compute_share", "one_hop", "one_hop_distinct", "two_hop"):
        assert rows["keep-graphs"][key] == rows["keep"][key]
    assert rows["keep-graphs"]["compute_share"] < 1.0
    assert rows["keep-graphs"]["captures"] >= 1 and rows["keep"]["captures"] == 0
    assert "the faster KEEP (graphs or eager) vs the faster full recomputation" in r["verdict"]


def test_keep_ratios_reach_every_keep_row(tmp_path):
    """`--keep-ratios 1,1`: KEEP (eager, its ablations and from graphs) recomputes every
    segment at every layer, so it is full recomputation: every token agrees."""
    out = tmp_path / "keep.json"
    argv = ["--quick", "--segments", "10", "--requests", "2", "--weights", "", "--graphs",
            "emulate", "--keep-ratios", "1,1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    for name in ("keep", "keep-no-static", "keep-one-hop", "keep-no-balance", "keep-graphs"):
        assert rows[name]["compute_share"] == 1.0 and rows[name]["agree"] == 1.0, name


def test_the_sweep_runs_every_operating_point_against_full_recomputation(tmp_path, capsys):
    from embodied_kv.bench.keep_sweep import BLEND_SHARES, KEEP_POINTS, keep_name

    out = tmp_path / "sweep.json"
    argv = ["--quick", "--sweep", "--segments", "10", "--requests", "2", "--weights", ""]
    assert main([*argv, "--graphs", "off", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    names = ["full", *[keep_name(*p) for p in KEEP_POINTS],
             *[f"cacheblend@{s:g}" for s in BLEND_SHARES]]  # fmt: skip
    assert [row["method"] for row in r["rows"]] == names
    share = {row["method"]: row["compute_share"] for row in r["rows"]}
    keeps = [share[keep_name(*p)] for p in KEEP_POINTS]  # lower ratios: less recomputed
    assert keeps == sorted(keeps, reverse=True) and keeps[0] > keeps[-1]
    front = r["sweep"]["10"]
    assert set(front["points"]) == set(names) and front["frontier"]["keep"]
    assert r["verdict"].startswith("sweep: ") and r["verdict"] in capsys.readouterr().out


def test_a_keep_point_is_dominated_only_by_a_cacheblend_point_as_fast_and_as_faithful():
    from embodied_kv.bench.keep_sweep import frontier

    def row(method, ttft, same, two=0.5):
        return {"method": method, "ttft_ms": ttft, "speedup_vs_full": 1.0, "compute_share": 0.5,
                "two_hop": two, "same_answer": same, "one_hop": 0.5}  # fmt: skip

    f = frontier([row("full", 10, 1.0), row("keep@a", 5, 0.8), row("keep@b", 4, 0.6),
                  row("keep@c", 6, 0.7), row("cacheblend@x", 4, 0.7),
                  row("cacheblend@y", 3, 0.9, two=0.4)])  # fmt: skip
    assert f["frontier"] == {"keep": ["keep@a", "keep@b"], "cacheblend": ["cacheblend@y"]}
    # x beats b (as fast, more faithful) and c (faster, as faithful); y beats a, b and c on
    # TTFT and same-answer but loses on two-hop, so it dominates none of them
    assert f["keep_dominated_by"] == {"keep@a": [], "keep@b": ["cacheblend@x"],
                                      "keep@c": ["cacheblend@x"]}  # fmt: skip
