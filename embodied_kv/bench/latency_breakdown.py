"""`embodied-kv bench latency --breakdown`: where one action's time goes, region by region,
on the graphs engine.

A separate pass after the headline measurement: each region's method is wrapped on its
instance for the pass only (the original comes back afterwards), and the wrapper reads the
device clock (timing.device_clock: on CUDA it synchronizes first) before and after the
call. The syncs this adds stay out of the headline numbers; they are in this pass's
`action_s`, so its action median is its own, not the headline's.

    vision        the graph runner's vision tower (engine.graphs.vision); part of
                  embed_prefix, not added to the others
    embed_prefix  vision + text embedding (model.embed_prefix)
    prefill       the one prefill of the frame (engine.manager.prefill_frame: the packed
                  step, engine.graphs.step)
    denoise       the action expert's Euler steps (model.sample_actions)
    host/other    action_s - embed_prefix - prefill - denoise, per cycle: the noise, the
                  chunk's copy to the host, the action queue, Python between the regions

Each figure is the median over cycles; host/other is computed per cycle before its
median, and is >= 0 by construction (every region runs inside the cycle's action window,
read on the same clock), clamped at 0 against rounding.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from embodied_kv.bench.report import print_table
from embodied_kv.engine.engine import Engine
from embodied_kv.model.vla import Observation
from embodied_kv.timing import device_clock, elapsed_ms

TIMED = ("vision", "embed_prefix", "prefill", "denoise")  # wrapped methods
SUMMED = ("embed_prefix", "prefill", "denoise")  # disjoint: together, the timed part
REGIONS = (*TIMED, "host/other")


def targets(model, engine: Engine) -> dict[str, tuple[object, str]]:
    """Region -> (instance, method name) that the region's time is spent in."""
    if engine.graphs is None:
        raise ValueError("the breakdown runs on the graphs engine (graph_mode cuda/emulate)")
    return {
        "vision": (engine.graphs, "vision"),
        "embed_prefix": (model, "embed_prefix"),
        "prefill": (engine.manager, "prefill_frame"),
        "denoise": (model, "sample_actions"),
    }


@contextmanager
def timed_methods(
    where: dict[str, tuple[object, str]], clock: Callable[[], float], spent: dict[str, float]
) -> Iterator[None]:
    """While inside, every call of a wrapped method adds its ms to spent[region]."""

    def timed(region: str, method: Callable) -> Callable:
        def call(*args, **kwargs):
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent[region] = spent.get(region, 0.0) + elapsed_ms(start, clock)

        return call

    restore = []
    try:
        for region, (obj, name) in where.items():
            own = name in vars(obj)  # an instance attribute already (else: the class's)
            original = getattr(obj, name)
            setattr(obj, name, timed(region, original))
            restore.append((obj, name, own, original))
        yield
    finally:
        for obj, name, own, original in reversed(restore):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)  # the class's method shows through again


def breakdown(
    model, engine: Engine, observations: Iterable[Observation], warmup: int
) -> tuple[dict[str, float], float]:
    """One cycle per observation on `engine` (graphs) -> (region -> median ms, the pass's
    own action_s median in ms); the first `warmup` cycles are not counted."""
    spent: dict[str, float] = {}
    samples: dict[str, list[float]] = {r: [] for r in REGIONS}
    actions = []
    model.graphs = engine.graphs  # the engines share the model (and its weights)
    with timed_methods(targets(model, engine), device_clock(model.device), spent):
        for i, obs in enumerate(observations):
            spent.clear()
            engine.observe(obs)
            action_ms = engine.cycle(engine.frame * engine.cfg.replan_every).action_s * 1e3
            if i < warmup:
                continue
            actions.append(action_ms)
            for region in TIMED:
                samples[region].append(spent.get(region, 0.0))
            other = action_ms - sum(spent.get(r, 0.0) for r in SUMMED)
            samples["host/other"].append(max(0.0, other))
    if not actions:
        raise ValueError(f"no cycle after {warmup} warmup cycles")
    medians = {r: statistics.median(v) for r, v in samples.items()}
    return medians, statistics.median(actions)


def report(rows: list[dict]) -> None:
    """The breakdown table of the rows that carry one."""
    rows = [r for r in rows if r.get("breakdown_ms")]
    if not rows:
        return
    print("\nbreakdown (graphs engine, synchronized per region; median ms; vision is part "
          "of embed_prefix)")  # fmt: skip
    print_table(
        ["cams", "action_ms", *REGIONS],
        [
            [r["cameras"], r["breakdown_action_ms"], *(r["breakdown_ms"][k] for k in REGIONS)]
            for r in rows
        ],
    )
