"""`bench vlcache --quick` end to end on a weights file the test writes (random world weights
in the trained layout): every section, every method at both acceptance budgets, the verdict."""

import json

import numpy as np
import pytest

from embodied_kv.bench.harness import paired_difference
from embodied_kv.bench.vlcache import METHODS, main, verdict
from embodied_kv.model.trained import TOKENIZER_FILE, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.loop import save_checkpoint


def test_quick_run_reports_every_row(tmp_path, capsys):
    tok = save_tokenizer(tmp_path / TOKENIZER_FILE)
    weights = save_checkpoint(build_model(world_config(), tokenizer_path=str(tok)), tmp_path)
    out = tmp_path / "vlcache.json"
    argv = ["--quick", "--scenes", "1", "--questions", "3", "--image-size", "32",
            "--repeats", "2", "--weights", str(weights), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(out.read_text())
    (row,) = r["speed"]["rows"]
    assert row["budget"] == 0.1 and 0 < row["kv_bytes"] < row["kv_bytes_full"]
    assert row["decode_speedup"] > 0 and row["attention_speedup"] > 0 and row["expert_speedup"] > 0
    assert r["speed"]["prefill"]["prefill_ms"] > 0 and "overhead" in r["speed"]["prefill"]
    want = {"full@1"} | {f"{m}@{b}" for m in METHODS if m != "full" for b in ("0.05", "0.1")}
    assert set(r["fidelity"]) == want and set(r["qa"]) == want
    full = r["fidelity"]["full@1"]
    assert full["top1"] == full["greedy32_exact"] == full["hit_rate"] == 1.0
    assert full["chunk_err"] == 0.0  # every row kept: the full prefix's chunk, bytes
    for k, f in r["fidelity"].items():
        assert 0 <= f["hit_rate"] <= 1 and 0 <= f["greedy32_prefix"] <= 1, k
        assert f["chunk_err"] > 0 or k == "full@1", k
    assert all(0 <= v <= 1 for v in r["qa"].values())
    assert r["verdict"]["line"].startswith("VERDICT") and isinstance(r["verdict"]["pass"], bool)
    assert r["verdict"]["line"] in capsys.readouterr().out


def test_verdict_names_every_losing_row():
    qa = {"full@1": 0.9}
    qa |= {f"{m}@{b}": 0.5 for m in METHODS if m != "full" for b in ("0.05", "0.1")}
    qa["vlcache@0.1"] = 0.88
    ok, line = verdict(qa)
    assert ok and "PASS" in line
    qa["h2o@0.05"] = 0.6
    ok, line = verdict(qa)
    assert not ok and "h2o@0.05 0.600 > vlcache 0.500" in line
    qa["h2o@0.05"], qa["vlcache@0.1"] = 0.5, 0.86
    ok, line = verdict(qa)
    assert not ok and "+4.0 points" in line


def test_the_verdict_quotes_the_paired_error_of_the_points_lost():
    full = [("count", True)] * 8 + [("colour", False)] * 2
    ours = [("count", True)] * 6 + [("count", False)] * 2 + [("colour", False)] * 2
    lost, se = paired_difference([ok for _, ok in full], [ok for _, ok in ours])
    d = np.array([0.0] * 6 + [1.0] * 2 + [0.0] * 2)
    assert lost == pytest.approx(0.2) and se == pytest.approx(d.std(ddof=1) / np.sqrt(10))
    qa = {"full@1": 0.8, "vlcache@0.1": 0.6}
    qa |= {f"{m}@{b}": 0.1 for m in METHODS if m != "full" for b in ("0.05", "0.1")
           if f"{m}@{b}" not in qa}  # fmt: skip
    ok, line = verdict(qa, {"full@1": full, "vlcache@0.1": ours})
    assert not ok and f"+20.0 ± {se * 100:.1f} SE points lost, 10 questions" in line
