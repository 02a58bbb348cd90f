"""CI check of the trained `world` model the package ships (embodied_kv/data/world/):
on a small held-out set, through the real engine, it must stay at or above thresholds a
little below what the shipped weights measure on this set. The issue's targets (QA 90 %,
one-hop 85 %, two-hop 80 %, success 80 %) are NOT all reached by the weights shipped now:
the 2026-11-27 joint fine-tune with the object-centre regression (run objjb,
docs/world_training.md "Object centres"), from session #5's weights. The thresholds guard
the level they reach, one item under it on this set (shipped now: QA 0.875 = 21 of 24,
one-hop 1.0, two-hop 1.0, success 0.75 = 9 of 12; session #5's: QA 0.75, one-hop 0.917,
two-hop 0.917, success 3 of 12; random weights 0 everywhere), and are to be raised to the
targets' margins when better weights ship. The file must be there: a checkout without it
fails here (it is not skipped)."""

from __future__ import annotations

from embodied_kv.engine.loading import SHIPPED, shipped_weights
from embodied_kv.eval.items import EvalConfig
from embodied_kv.eval.world import evaluate
from embodied_kv.model.trained import load_trained

MIN_QA = 0.83  # 20 of 24
MIN_ONE_HOP = 0.91  # 11 of 12
MIN_TWO_HOP = 0.91  # 11 of 12
MIN_SUCCESS = 0.66  # 8 of 12 episodes
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
