"""`embodied-kv eval visited`: the states a trained policy visits in closed loop, for
DAgger (issue 34; the file format and replay: world/visited.py).

Episodes run exactly as `eval world` runs them (the engine's unified loop, `flow`
actions, replanning every `replan_every` actions) but on training-side seeds: from
VISITED_SEED_BASE up, above every training seed (train/config.py: seed < 2^15 times
TRAIN_SEED_STRIDE = 2^32) and below EVAL_SEED_BASE (2^48), so neither the held-out eval
items nor the rollout samples are ever these. Each control cycle after the first (the
first is the episode's start, which `--first-share` already trains) records the state
before the policy's next chunk, until the task succeeds or the cycles run out.

    embodied-kv eval visited --weights out/run/weights.safetensors --episodes 400 \\
        --out out/visited.json
    embodied-kv train ... --visited out/visited.json --visited-share 0.5

`--delays 0,4,8 --executors naive,rtc-error` collects instead the states reached under an
injected inference delay (eval/delayed.py, `bench rtc`'s closed loop): each episode run
once per executor and delay, a state at every cycle's observation after the first. A
policy executed late, or through real-time chunking (which keeps the previous chunk's
plan), reaches states the plain loop does not: a grasp missed while the old plan went on
to the container, the arm above it with nothing held.
"""

from __future__ import annotations

import argparse

import numpy as np

from embodied_kv.eval import delayed
from embodied_kv.eval.items import EvalConfig
from embodied_kv.eval.runners import EngineRunner
from embodied_kv.eval.world import default_weights, make_engine
from embodied_kv.model.trained import load_trained
from embodied_kv.train.config import EVAL_SEED_BASE, TRAIN_SEED_STRIDE
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


def collect_delayed(model, episodes: int, first: int = 0, delays: tuple[int, ...] = (0, 4, 8),
                    executors: tuple[str, ...] = ("naive", "rtc-error"),
                    ticks: int = delayed.TICKS) -> list[VisitedState]:  # fmt: skip
    """Episodes first .. first+episodes-1 from VISITED_SEED_BASE, each run by every executor
    (eval/delayed.py EXECUTORS) at every delay -> the states seen at each cycle after the
    first, in that order (episode, executor, delay)."""
    if episodes < 1 or first < 0 or not delays or not executors:
        raise ValueError(f"episodes={episodes} >= 1, first={first} >= 0, delays={delays} and "
                         f"executors={executors} not empty")  # fmt: skip
    if any(d < 0 for d in delays):
        raise ValueError(f"delays={delays}: ticks, >= 0")
    runs = [(ex, delayed.make_engine(model, ex.rtc)) for ex in map(delayed.executor, executors)]
    out: list[VisitedState] = []
    for e in range(first, first + episodes):
        seed = VISITED_SEED_BASE + e

        def visit(acts: np.ndarray, seed: int = seed) -> None:
            out.append(VisitedState(seed, acts))

        for ex, engine in runs:
            for d in delays:
                delayed.run_episode(engine, ex, seed, d, ticks, visit)
    return out


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv eval visited",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--out", required=True, help="the states file (JSON, written atomically)")
    p.add_argument("--weights", default=None, help="own-layout weights (default: the shipped)")
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--first", type=int, default=0, help="first episode index (more states "
                   "for a file made before: another range)")  # fmt: skip
    p.add_argument("--delays", type=_ints, default=(), help="injected inference delays in "
                   "ticks, e.g. 0,4,8: collect under the delayed loop (default: the plain loop)")
    p.add_argument("--executors", default="naive,rtc-error", help="with --delays: of "
                   f"{','.join(delayed.EXECUTORS)}")  # fmt: skip
    a = p.parse_args(argv)
    weights = default_weights() if a.weights is None else a.weights
    if not weights:
        raise ValueError("no weights: pass --weights (no shipped world weights installed)")
    model = load_trained(weights, a.tokenizer or None)
    if a.delays:
        names = tuple(x.strip() for x in a.executors.split(",") if x.strip())
        states = collect_delayed(model, a.episodes, a.first, a.delays, names)
    else:
        cfg = EvalConfig()
        states = collect(EngineRunner(make_engine(model, cfg)), cfg, a.episodes, a.first)
    save_visited(states, a.out)
    steps = [len(s.actions) for s in states]
    print(f"eval visited: {len(states)} states from {a.episodes} episodes (weights {weights}); "
          f"executed actions per state {min(steps)}..{max(steps)} -> {a.out}")
    return 0
