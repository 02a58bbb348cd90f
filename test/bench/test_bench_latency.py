"""`bench latency` runs end to end on the tiny preset, with its --breakdown pass."""

import json

import pytest

from embodied_kv.bench import latency, latency_breakdown, latency_report, limit
from embodied_kv.kernels import expert_attention, prefill_tile
from embodied_kv.kernels.expert_attention import REDUCE
from embodied_kv.kernels.prefill_tile import KEY_SPLITS
from embodied_kv.model.config import get_preset
from embodied_kv.model.expert import FUSED_LAYER_STEP
from embodied_kv.model.vla import build_model


def test_bench_latency_breakdown_json(tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--repeats", "2", "--breakdown"]
    assert latency.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny" and result["graph_mode"] == "emulate"
    assert result["queue_timeouts"] == 0  # no persistent launch on a CPU: none kept
    rows = result["rows"]
    assert [r["cameras"] for r in rows] == list(range(1, get_preset("tiny").num_cameras + 1))
    for r in rows:
        assert r["graphs_ms"]["median"] > 0 and r["eager_ms"]["median"] > 0
        for key in ("limit_ms", "graphs_over_limit", "limit_48_text_ms",
                    "graphs_over_limit_48_text", "limit_rows"):
            assert r[key] is None, key  # tiny on a CPU: no limit is judged
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


def test_the_limit_at_48_text_tokens_is_the_published_one():
    """5.3 / 6.6 ms for 2 / 3 cameras and a 48-token prompt (560 / 816 prefix rows)."""
    assert limit.prefix_rows(2) == 560 and limit.prefix_rows(3) == 816
    assert round(limit.limit_ms(2, 560), 1) == 5.3
    assert round(limit.limit_ms(3, 816), 1) == 6.6


def test_the_limit_grows_with_the_rows_and_refuses_too_few():
    at = [limit.limit_ms(2, n) for n in (560, 600, 663, 800)]
    assert at == sorted(at) and len(set(at)) == 4
    # one more text row costs at least its backbone GEMM FLOPs (2 x 1.98e9 at 990 TFLOP/s)
    assert at[1] - at[0] > 40 * 2 * limit.BACKBONE_LINEAR_PARAMS / limit.PEAK_FLOPS * 1e3
    with pytest.raises(ValueError, match="cannot hold 2 cameras"):
        limit.limit_ms(2, 500)


def test_a_row_is_judged_against_the_limit_of_the_rows_it_measured():
    """The H100 run of 2026-11-23: 25.5 / 28.1 ms over 663 / 921 prefix rows (a byte-level
    prompt of ~150 tokens); dividing by the 48-token limit overstated the gap."""
    two, three = latency.limit_fields(2, 663, 25.5), latency.limit_fields(3, 921, 28.1)
    assert round(two["limit_ms"], 2) == 5.75 and round(three["limit_ms"], 2) == 7.06
    assert round(two["graphs_over_limit"], 2) == 4.44
    assert round(three["graphs_over_limit"], 2) == 3.98
    assert round(two["limit_48_text_ms"], 1) == 5.3 and round(three["limit_48_text_ms"], 1) == 6.6
    assert round(two["graphs_over_limit_48_text"], 2) == 4.80
    assert two["limit_rows"] == 663
    assert two["graphs_over_limit"] < two["graphs_over_limit_48_text"]


def test_the_verdict_names_both_limits(capsys):
    row = {"cameras": 2, "prefix_len": 663, "graphs_ms": {"median": 25.5, "p90": 26.0},
           "eager_ms": {"median": 261.0}, "eager_over_graphs": 10.2,
           **latency.limit_fields(2, 663, 25.5)}  # fmt: skip
    latency_report.report({"rows": [row], "graph_mode": "cuda", "goal_x_limit": 1.5})
    out = capsys.readouterr().out
    assert "VERDICT FAIL" in out and "4.44x the limit of its 663 prefix rows" in out
    assert "4.80x the 48-text-token limit" in out


def test_bench_latency_rtc_row(tmp_path, capsys):
    """--rtc: a third engine runs the guided loop from its graph (emulation on a CPU); each
    row reports it beside the plain graphs path."""
    out = tmp_path / "latency_rtc.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--repeats", "1", "--rtc", "error"]
    assert latency.main([*argv, "--json", str(out)]) == 0
    for r in json.loads(out.read_text())["rows"]:
        assert r["rtc"] == "error" and r["graphs_rtc_ms"]["median"] > 0
        assert r["rtc_over_graphs"] > 0
    assert "RTC (error) from its graph" in capsys.readouterr().out


def test_bench_latency_unfused_row(tmp_path, capsys):
    """--unfused-row (on by default on CUDA): a graphs engine captured with the expert's
    other layer-step (fused kernels or the chain), timed beside the product's."""
    out = tmp_path / "latency_unfused.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--quick", "--repeats", "1", "--unfused-row"]
    assert latency.main([*argv, "--json", str(out)]) == 0
    for r in json.loads(out.read_text())["rows"]:
        assert r["graphs_unfused_ms"]["median"] > 0 and r["unfused_over_fused"] > 0
        assert r["graphs_fused_ms"]["median"] > 0 and r["layer_step"] in ("fused", "unfused")
        assert r["graphs_prev_ms"]["median"] > 0 and r["prev_over_graphs"] > 0
        assert r["graphs_unsplit_ms"]["median"] > 0 and r["unsplit_over_graphs"] > 0
        assert r["graphs_noprefetch_ms"]["median"] > 0 and r["noprefetch_over_graphs"] > 0
    printed = capsys.readouterr().out
    assert "layer-step unfused (the chain)" in printed
    assert "without the untimed changes (graphs_prev)" in printed
    assert "without the key splits (graphs_unsplit)" in printed
    assert "without the weight prefetch (graphs_noprefetch)" in printed


def test_configure_sets_each_engines_switches_and_restores_the_products():
    m = build_model(get_preset("tiny"))
    latency.configure(m, "graphs_prev")
    assert not m.expert.rope_in_attention and not m.backbone.fused_epilogues
    assert m.expert.fused_layer_step == FUSED_LAYER_STEP and prefill_tile.KEY_SPLITS == 1
    assert expert_attention.REDUCE == "launch"  # the attention's two launches
    assert not m.expert.prefetch_weights
    latency.configure(m, "graphs_noprefetch")
    assert not m.expert.prefetch_weights and m.expert.rope_in_attention
    assert prefill_tile.KEY_SPLITS == KEY_SPLITS and expert_attention.REDUCE == REDUCE
    latency.configure(m, "graphs_unsplit")
    assert m.expert.rope_in_attention and prefill_tile.KEY_SPLITS == 1
    assert expert_attention.REDUCE == REDUCE
    latency.configure(m, "graphs_alt")
    assert m.expert.fused_layer_step != FUSED_LAYER_STEP and m.backbone.fused_epilogues
    latency.configure(m, "graphs")
    assert m.expert.rope_in_attention and m.backbone.fused_epilogues
    assert m.expert.fused_layer_step == FUSED_LAYER_STEP and m.expert.prefetch_weights
    assert prefill_tile.KEY_SPLITS == KEY_SPLITS and expert_attention.REDUCE == REDUCE
