"""`embodied-kv eval visited`: the states a trained policy visits in closed loop, for
DAgger (issue 34; the file format and replay: world/visited.py).

Episodes run exactly as `eval world` runs them (the engine's unified loop, `flow`
actions, replanning every `replan_every` actions) but on training-side seeds: from
VISITED_SEED_BASE up, above every training seed (train/loop.py: seed < 2^15 times
TRAIN_SEED_STRIDE = 2^32) and below EVAL_SEED_BASE (2^48), so neither the held-out eval
items nor the rollout samples are ever these. Each control cycle after the first (the
first is the episode's start, which `--first-share` already trains) records the state
before the policy's next chunk, until the task succeeds or the cycles run out.

    embodied-kv eval visited --weights out/run/weights.safetensors --episodes 400 \\
        --out out/visited.json
    embodied-kv train ... --visited out/visited.json --visited-share 0.5
"""

from __future__ import annotations

import argparse

import numpy as np

from embodied_kv.eval.items import EvalConfig
from embodied_kv.eval.runners import EngineRunner
from embodied_kv.eval.world import default_weights, make_engine
from embodied_kv.model.trained import load_trained
from embodied_kv.train.loop import EVAL_SEED_BASE, TRAIN_SEED_STRIDE
from embodied_kv.world.scene import REAL_ACTION_DIMS
from embodied_kv.world.tasks import episode
from embodied_kv.world.visited import VisitedState, save_visited

VISITED_SEED_BASE = 2**15 * TRAIN_SEED_STRIDE  # 2^47: above training, below eval seeds
assert VISITED_SEED_BASE < EVAL_SEED_BASE


def collect(runner, cfg: EvalConfig, episodes: int, first: int = 0) -> list[VisitedState]:
    """Closed-loop episodes first .. first+episodes-1 from VISITED_SEED_BASE -> the states
    the policy reached (not its start, not after success)."""
    if episodes < 1 or first < 0:
        raise ValueError(f"episodes={episodes} must be >= 1 and first={first} >= 0")
    out: list[VisitedState] = []
    for e in range(first, first + episodes):
        seed = VISITED_SEED_BASE + e
        scene, task = episode(seed)
        runner.begin()
        executed: list[np.ndarray] = []
        for c in range(cfg.max_cycles):
            if c > 0:
                out.append(VisitedState(seed, np.array(executed).reshape(-1, REAL_ACTION_DIMS)))
            chunk = runner.act(scene, task.instruction, c)
            for a in chunk[: cfg.replan_every]:
                act = np.asarray(a[:REAL_ACTION_DIMS], dtype=np.float64)
                scene.step(act)
                executed.append(act)
            if task.success(scene):  # the expert's "done" is exactly this
                break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv eval visited",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--out", required=True, help="the states file (JSON, written atomically)")
    p.add_argument("--weights", default=None, help="own-layout weights (default: the shipped)")
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--first", type=int, default=0, help="first episode index (more states "
                   "for a file made before: another range)")  # fmt: skip
    a = p.parse_args(argv)
    weights = default_weights() if a.weights is None else a.weights
    if not weights:
        raise ValueError("no weights: pass --weights (no shipped world weights installed)")
    cfg = EvalConfig()
    runner = EngineRunner(make_engine(load_trained(weights, a.tokenizer or None), cfg))
    states = collect(runner, cfg, a.episodes, a.first)
    save_visited(states, a.out)
    steps = [len(s.actions) for s in states]
    print(f"eval visited: {len(states)} states from {a.episodes} episodes (weights {weights}); "
          f"executed actions per state {min(steps)}..{max(steps)} -> {a.out}")
    return 0
