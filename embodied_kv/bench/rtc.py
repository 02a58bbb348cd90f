"""`embodied-kv bench rtc`: real-time chunking against naive switching and temporal
ensembling, closed loop on the world (the `world_smooth` preset's shipped weights by
default: waypoint actions, H = 30; `--world world`: far targets, H = 10) and the simulated
robot, with an injected inference delay d; and RTC's latency cost at pi05 widths.

The closed loop, its timeline and the methods: eval/delayed.py.

Metrics, over the arm's position targets (x, y, z; the gripper's open / close is a step of
2 by design), robot units:
success (the task done within the tick budget), the jump |a_t - a_{t-1}| (L2) at each
switch (the first tick executed from a newly landed chunk): max and p95, and jerk: the mean
L2 norm of the third difference of the executed actions (units / tick^3). `lead_gap`: per
chunk, the largest L2 gap between its first d actions (stale when it lands: RTC freezes them,
W = 1) and the previous chunk's for the same ticks, averaged; it shows what the guidance does
where it is strongest. `switch_gap`: at the switch, the action executed against the one the
old chunk had for that tick (mean L2): the discontinuity chunking adds, apart from the
policy's own steps (`world`'s expert commands far targets: z jumps +1 <-> -1 between
phases, so |a_t - a_{t-1}| at a switch also counts steps the policy takes anyway;
`world_smooth`'s waypoints step by the arm's motion, <= 0.56; `step_p95` is the p95 of
|a_t - a_{t-1}| at every other tick, for scale).

Latency: ActionExpert.sample against the guided loop (error, vjp) at pi05 widths (expert
width 1024, MLP 4096, 8 heads of 256, 1 KV head, H 50 x 32, 10 steps) over a prefix of 3
cameras + 48 text tokens (816 rows, bucket 1024), `--layers` expert layers (the cost is
linear in them: pi0.5 has 18), eager on this device, interleaved rounds.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from embodied_kv.bench import harness
from embodied_kv.bench.report import print_table
from embodied_kv.engine.loading import shipped_weights
from embodied_kv.eval.delayed import (
    EXECUTORS,
    PREFIX_BAND,
    REPLAN,
    TICKS,
    Trace,
    make_engine,
    methods,
    run_episode,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.expert import ActionExpert
from embodied_kv.model.rtc import SCHEDULES, RTCConfig, sample_guided
from embodied_kv.model.trained import WORLD_PRESETS, load_trained
from embodied_kv.model.vla import MAX_POSITIONS, denoise_rows
from embodied_kv.storage.arena import ArenaSpec, KVArena
from embodied_kv.train.config import EVAL_SEED_BASE

DELAYS = (0, 2, 4, 8)
DEFAULT_WORLD = "world_smooth"  # of the world presets (model/trained.py WORLD_PRESETS)
SEED = EVAL_SEED_BASE + 7 * 10**6  # held out, apart from eval world's items
WARM_SEED = SEED - 1  # each row's unscored first episodes (the measured delay set), down
WARM_EPISODES = 5
PI05_PREFIX = 3 * 256 + 48  # 3 cameras + the published 48-token prompt


def summarise(traces: list[Trace]) -> dict:
    jumps = sorted(j for t in traces for j in t.jumps)
    gaps = [g for t in traces for g in t.lead_gaps]
    sgaps = [g for t in traces for g in t.switch_gaps]
    steps = sorted(x for t in traces for x in t.steps)
    jerks = []
    for t in traces:
        a = np.array(t.actions)
        if len(a) >= 4:
            jerks += list(np.linalg.norm(a[3:] - 3 * a[2:-1] + 3 * a[1:-2] - a[:-3], axis=1))
    return {
        "success": float(np.mean([t.success for t in traces])),
        "switches": len(jumps),
        "jump_mean": float(np.mean(jumps)) if jumps else float("nan"),
        "jump_max": max(jumps) if jumps else float("nan"),
        "jump_p95": harness.quantile(jumps, 0.95) if jumps else float("nan"),
        "jerk_mean": float(np.mean(jerks)) if jerks else float("nan"),
        "lead_gap": float(np.mean(gaps)) if gaps else float("nan"),
        "switch_gap": float(np.mean(sgaps)) if sgaps else float("nan"),
        "step_p95": harness.quantile(steps, 0.95) if steps else float("nan"),
        "ticks": int(sum(len(t.executed) for t in traces)),
    }


def closed_loop(model, episodes: int, env, execution_horizon: int = 0, ticks: int = TICKS,
                prefix_band: int = PREFIX_BAND, only: tuple[str, ...] = (),
                **rtc) -> list[dict]:  # fmt: skip
    """`rtc`: further RTCConfig fields of the guided methods (schedule, max_guidance);
    `only`: these methods (by name; naive always runs: the ratios' base)."""
    rows = []
    for ex in methods(execution_horizon, prefix_band, **rtc):
        if only and ex.name not in only and ex.name != "naive":
            continue
        engine = make_engine(model, ex.rtc)
        for d in DELAYS:
            warm_delay(engine, ex, d, ticks)
            before = copy.copy(engine.loop.rtc.counters) if engine.loop.rtc else None
            traces = [run_episode(engine, ex, SEED + e, d, ticks) for e in range(episodes)]
            row = {"method": ex.name, "delay": d, **summarise(traces)}
            # per episode: the ticks it took to succeed, -1 where it did not within `ticks`
            row["episode_ticks"] = [len(t.executed) if t.success else -1 for t in traces]
            if engine.loop.rtc is not None:
                c = engine.loop.rtc.counters
                row["guided_chunks"] = c.guided - before.guided
                row["chunks"] = c.chunks - before.chunks
            rows.append(row)
            harness.progress(env, f"{ex.name} d={d}: success {row['success']:.2f}, jump max "
                                  f"{row['jump_max']:.3f}")  # fmt: skip
    return rows


def warm_delay(engine, ex, delay: int, ticks: int = TICKS) -> None:
    """The measured d (rtc.delay: measured) persists across episodes, as on a robot whose
    delay is its machine's: unscored episodes at `delay` until a chunk landed that late (a
    short one may end before), so a row's first guided chunk does not hold the previous
    row's d."""
    for w in range(WARM_EPISODES):
        run_episode(engine, ex, WARM_SEED - w, delay, ticks)
        if engine.queue.switches.last_delay == delay:
            return


def latency(layers: int, repeats: int, device: str) -> dict:
    """ms per chunk of the plain and the guided Euler loops at pi05 widths."""
    cfg = get_preset("pi05", layers=layers)
    e = cfg.expert
    torch.manual_seed(0)
    expert = ActionExpert(cfg, MAX_POSITIONS).to(device).eval()
    rows = denoise_rows(PI05_PREFIX, 1024)
    arena = KVArena(ArenaSpec(e.layers, 1, rows, e.kv_heads, e.head_dim, torch.float32), device)
    arena.k.normal_()
    arena.v.normal_()
    plen = torch.tensor(PI05_PREFIX, device=device)
    h, a = cfg.action_horizon, cfg.action_dim
    noise = torch.randn(h, a, device=device)
    target = torch.randn(h, a, device=device)
    from embodied_kv.model.rtc import prefix_weights

    w = prefix_weights(h, 4, 5, "exp").to(device)

    def plain():
        return harness.time_once(lambda: expert.sample(arena, 0, plen, noise, rows), device)

    def guided(kind):
        return lambda: harness.time_once(
            lambda: sample_guided(expert, arena, 0, plen, noise, target, w, 5.0, kind, rows),
            device,
        )

    got = harness.interleave_calls(
        {"plain": plain, "rtc-error": guided("error"), "rtc-vjp": guided("vjp"),
         "rtc-prefix": guided("prefix")},
        warmup=1, repeats=repeats,
    )  # fmt: skip
    out = {"layers": layers, "prefix_rows": PI05_PREFIX, "row_bucket": rows}
    for name, ms in got.items():
        out[name] = harness.Stats.of(ms).as_dict()
    base = out["plain"]["median"]
    for name in ("rtc-error", "rtc-vjp", "rtc-prefix"):
        out[name]["x_plain"] = out[name]["median"] / base
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv bench rtc", description=__doc__.split("\n")[0])
    harness.add_common_args(p)
    p.add_argument("--episodes", type=int, default=0, help="per method and delay (0: 6 quick, "
                   "60 full)")  # fmt: skip
    p.add_argument("--layers", type=int, default=0, help="pi05-width expert layers for the "
                   "latency rows (0: 1 quick, 2 full; pi0.5 has 18)")  # fmt: skip
    p.add_argument("--world", choices=WORLD_PRESETS, default=DEFAULT_WORLD,
                   help="the world model: world_smooth (waypoints, H 30) or world (far "
                        "targets, H 10)")  # fmt: skip
    p.add_argument("--weights", default="", help="a world model's weights file (default: "
                   "the --world preset's shipped weights), e.g. a `train --prefix-max` run's")
    p.add_argument("--ticks", type=int, default=TICKS, help="per episode (default: "
                   f"{TICKS}, eval world's budget)")  # fmt: skip
    p.add_argument("--execution-horizon", type=int, default=0,
                   help="RTC's s (rtc.execution_horizon; default 0: the replan period, 5)")
    p.add_argument("--schedule", choices=SCHEDULES, default=RTCConfig.schedule,
                   help="RTC's W over [d, H - s) (rtc.schedule; hard: only the d stale actions "
                        "guided)")  # fmt: skip
    p.add_argument("--max-guidance", type=float, default=RTCConfig.max_guidance,
                   help="RTC's beta (rtc.max_guidance)")
    p.add_argument("--methods", default="", help="comma-separated methods to run (default: "
                   f"all of {', '.join(EXECUTORS)}; naive always runs)")  # fmt: skip
    p.add_argument("--prefix-band", type=int, default=PREFIX_BAND,
                   help="rtc-prefix-band's rows error-guided after the held ones (rtc.band; "
                        f"default {PREFIX_BAND})")  # fmt: skip
    a = harness.parse(p, argv)
    env = harness.Environment.start(a, argv)
    episodes = a.episodes or (6 if a.quick else 60)
    layers = a.layers or (1 if a.quick else 2)
    weights = Path(a.weights) if a.weights else shipped_weights(a.world)
    if weights is None:
        p.error(f"bench rtc needs the {a.world} preset's shipped weights "
                f"(embodied_kv/data/{a.world}/)")  # fmt: skip
    try:
        model = load_trained(weights)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if model.cfg.name not in WORLD_PRESETS:
        p.error(f"{weights}: a {model.cfg.name} model; bench rtc runs the world presets "
                f"{WORLD_PRESETS}")  # fmt: skip
    s = a.execution_horizon
    rtc = {"schedule": a.schedule, "max_guidance": a.max_guidance}
    try:
        RTCConfig(**rtc, band=a.prefix_band)  # a bad value fails here, before the episodes
    except ValueError as e:
        p.error(str(e))
    only = tuple(m.strip() for m in a.methods.split(",") if m.strip())
    unknown = sorted(set(only) - set(EXECUTORS))
    if unknown:
        p.error(f"--methods {','.join(unknown)}: not one of {', '.join(EXECUTORS)}")
    rows = closed_loop(model, episodes, env, s, a.ticks, a.prefix_band, only, **rtc)
    lat = latency(layers, 3 if a.quick else 7, a.device)
    harness.progress(env, "latency done")
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()[:16]
    print(f"bench rtc: {model.cfg.name} preset (H {model.cfg.action_horizon}), weights {weights} "
          f"({sha}), {episodes} episodes per row, {a.ticks} ticks each; cycle every "
          f"max({REPLAN}, d) ticks; RTC s = {s or REPLAN}, schedule {a.schedule}, beta "
          f"{a.max_guidance:g}")  # fmt: skip
    keys = ["success", "switches", "jump_mean", "jump_max", "jump_p95", "step_p95", "jerk_mean",
            "lead_gap", "switch_gap"]  # fmt: skip
    naive = {r["delay"]: r for r in rows if r["method"] == "naive"}
    table = []
    for r in rows:
        base = naive[r["delay"]]
        for k in ("jump_max", "jump_mean"):  # naive / method: > 1 is a smaller jump
            r[f"{k}_naive_over"] = base[k] / r[k] if r[k] else math.inf
        table.append([r["method"], r["delay"], *[r[k] for k in keys], r["jump_max_naive_over"],
                      r["jump_mean_naive_over"]])  # fmt: skip
    print_table(["method", "d", *keys, "naive/max", "naive/mean"], table)
    print("episodes that did not succeed within the budget (of each row's):",
          ", ".join(f"{r['method']} d={r['delay']}: {r['episode_ticks'].count(-1)}"
                    for r in rows))  # fmt: skip
    print("rtc-prefix holds the d stale actions clean (training-time RTC: weights trained "
          f"with `train --prefix-max`); rtc-prefix-band also error-guides the {a.prefix_band} "
          "rows after them")  # fmt: skip
    print(f"latency at pi05 widths, {layers} expert layer(s), {a.device}:")
    print_table(["loop", "median_ms", "p10_ms", "p90_ms", "x_plain"], [
        [k, lat[k]["median"], lat[k]["p10"], lat[k]["p90"], lat[k].get("x_plain", 1.0)]
        for k in ("plain", "rtc-error", "rtc-vjp", "rtc-prefix")
    ])  # fmt: skip
    result = {
        "benchmark": "rtc",
        "quick": a.quick,
        "config": {
            "world": model.cfg.name,
            "action_horizon": model.cfg.action_horizon,
            "episodes": episodes,
            "ticks": a.ticks,
            "replan_every": REPLAN,
            "delays": list(DELAYS),
            "seed": SEED,
            "weights": str(weights),
            "weights_sha256": sha,
            "rtc": asdict(RTCConfig(enabled=True, execution_horizon=s, **rtc)),
            "prefix_band": a.prefix_band,
            "methods": sorted({r["method"] for r in rows}),
        },  # fmt: skip
        "closed_loop": rows,
        "latency_pi05_widths": lat,
    }
    harness.finish(result, env, a.json)
    return 0
