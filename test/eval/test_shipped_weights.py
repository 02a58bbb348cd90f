"""CI check of the trained `world` model the package ships (embodied_kv/data/world/):
on a small held-out set, through the real engine, it must stay at or above thresholds a
little below what the shipped weights measure on this set. The weights shipped now (run
objjg2 of 2026-11-27 #2, docs/world_training.md "Action bins and named things") reach the
issue's success, QA and left/right targets on the larger eval (success 0.82 of 50 and 0.85
of 100; QA 0.95 and "left of" 0.943 over 300 questions); on this set they measure QA 0.833
= 20 of 24, one-hop 1.0, two-hop 1.0, success 10 of 12 (the weights before: 21 of 24,
1.0, 1.0, 9 of 12; 24 questions hold 8 "left of": one answer moves QA by 0.04). The
thresholds: success 0.75 (9 of 12, one under), one-hop and two-hop 0.91 (11 of 12, one
under), QA 0.83 (20 of 24: the level measured, kept rather than lowered; the eval is
deterministic on a CPU). Random weights score 0 everywhere. The file must
be there: a checkout without it fails here (it is not skipped)."""

from __future__ import annotations

from embodied_kv.engine.loading import SHIPPED, shipped_weights
from embodied_kv.eval.items import EvalConfig
from embodied_kv.eval.world import evaluate
from embodied_kv.model.trained import load_trained

MIN_QA = 0.83  # 20 of 24
MIN_ONE_HOP = 0.91  # 11 of 12
MIN_TWO_HOP = 0.91  # 11 of 12
MIN_SUCCESS = 0.75  # 9 of 12 episodes
# held-out seeds (EvalConfig.seed); small enough for < 30 s on the 2-core CPU
CI_SET = EvalConfig(episodes=12, questions=24, memory=24)


def test_shipped_world_weights_meet_the_ci_thresholds():
    path = shipped_weights("world")
    assert path is not None, f"the shipped world model {SHIPPED['world']} is missing"
    row = evaluate(load_trained(path), CI_SET)
    got = {k: row[k] for k in ("qa", "one_hop", "two_hop", "success")}
    want = {"qa": MIN_QA, "one_hop": MIN_ONE_HOP, "two_hop": MIN_TWO_HOP, "success": MIN_SUCCESS}
    below = {k: (got[k], want[k]) for k in want if not got[k] >= want[k]}
    assert not below, f"below the CI thresholds (got, min): {below}; all: {got}"
