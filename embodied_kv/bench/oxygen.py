"""`embodied-kv bench oxygen`: unified KV + cross-frame batching vs isolated execution,
with each mechanism alone and the tasks as concurrent processes.

All modes run the same model and weights on the same observation stream. Every frame
spawns one language request (a narration of `tokens` tokens) besides its action chunk:

    isolated       prefill -> actions | prefill -> decode `tokens` steps alone   (each cycle)
    sharing_only   prefill -> actions | decode `tokens` steps alone, same slot
    batching_only  prefill -> actions | prefill | ceil(tokens / inflight) batched steps
    unified        prefill -> actions | ceil(tokens / inflight) batched steps    (OxyGen)
    concurrent     two OS processes, action and language, sharing the device

so `inflight` requests from consecutive frames decode together in steady state and
every mode produces the same tokens per cycle. Action frequency is OxyGen's: action
horizon / cycle latency (concurrent: of the action process). Latency is per request,
from the start of its frame's cycle to the end of the cycle that finishes it, on the
mode's own clock (its cycles back to back). The single-process modes run in lock-step,
one cycle of each per frame, and speedups are medians over rounds of isolated / mode
median cycle time; the two processes run after them in each round. `exact`: every
request's text is the same in every mode.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from embodied_kv.bench import harness, host_work
from embodied_kv.bench.oxygen_modes import MODES, make_runner
from embodied_kv.bench.oxygen_procs import ConcurrentTasks, observations
from embodied_kv.bench.report import print_table
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model
from embodied_kv.timing import device_clock

CONTROL_HZ = 50.0  # the robot's action rate; a cycle must end within replan_every ticks


def max_len_for(cfg, tokens: int) -> int:
    return 64 * math.ceil((cfg.prefix_tokens_max + tokens + 2) / 64)


def run_modes(runners: dict, obs, warmup: int, replan_every: int, clock) -> dict[str, dict]:
    """All modes in lock-step, one cycle of each per frame (the order rotating), so a
    burst of load from elsewhere hits every mode alike -> per mode: texts, per-cycle s,
    busy s, tokens and request latencies, counted after `warmup` cycles."""
    names = list(runners)
    out = {m: {"texts": {}, "cycle_s": [], "latency_s": [], "wall_s": 0.0} for m in names}
    own = dict.fromkeys(names, 0.0)  # each mode's own time: its cycles back to back
    started = {m: {} for m in names}
    tokens0 = {}
    for f, o in enumerate(obs):
        if f == warmup:
            tokens0 = {m: r.manager.counters.tokens for m, r in runners.items()}
        for m in names[f % len(names) :] + names[: f % len(names)]:
            started[m][f] = own[m]
            t0 = clock()
            res = runners[m].cycle(o, f, tick=f * replan_every)
            own[m] += clock() - t0
            rec = out[m]
            if f >= warmup:
                rec["cycle_s"].append(res.cycle_s)
                rec["wall_s"] += own[m] - started[m][f]
            for e in res.events:
                if e.done:
                    rec["texts"][e.request_id.split("@")[0]] = e.text  # id without epoch
                    if e.frame >= warmup:
                        rec["latency_s"].append(own[m] - started[m][e.frame])
    for m, r in runners.items():
        out[m]["tokens"] = r.manager.counters.tokens - tokens0[m]
        if hasattr(r, "finish_all"):
            done = [e for e in r.finish_all() if e.done]
            out[m]["texts"].update({e.request_id.split("@")[0]: e.text for e in done})
    return out


def summarise(runs: list[dict], horizon: int, period_s: float) -> dict:
    """Per mode, over rounds: medians of per-round figures; latency quantiles pooled."""
    cycle = [statistics.median(r["cycle_s"]) for r in runs]
    lat = sorted(x for r in runs for x in r["latency_s"])
    return {
        "cycle_ms": 1e3 * statistics.median(cycle),
        "cycle_ms_p10_p90": [1e3 * harness.quantile(sorted(cycle), q) for q in (0.1, 0.9)],
        "action_hz": horizon / statistics.median(cycle),
        "tokens_per_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
        "latency_ms_p50": 1e3 * harness.quantile(lat, 0.5) if lat else None,
        "latency_ms_p99": 1e3 * harness.quantile(lat, 0.99) if lat else None,
        "requests_timed": len(lat),
        "deadline_misses": sum(x > period_s for r in runs for x in r["cycle_s"]),
    }


def concurrent_round(procs: ConcurrentTasks, tokens: int, frames: int, warmup: int) -> dict:
    """One round of the two processes, in the single-process modes' terms."""
    res = procs.run(tokens, frames, warmup, seed=0)
    act, lang = res["action"], res["language"]
    return {
        "texts": lang["texts"],
        # a "cycle" ends when both tasks are done with the frame: the slower process sets it
        "cycle_s": [max(a, b) for a, b in zip(act["frame_s"], lang["frame_s"], strict=True)],
        "action_cycle_s": act["frame_s"],
        "wall_s": lang["wall_s"],
        "tokens": lang["tokens"],
        "latency_s": lang["frame_s"],  # each request is served at once, alone
    }


def measure(model, tokens, inflight, frames, warmup, repeats, procs) -> dict:
    c = model.cfg
    replan_every = max(1, c.action_horizon // 2)
    period = replan_every / CONTROL_HZ
    cfg = LoopConfig(
        period_s=1e9,
        narrate_every=1,
        narration_tokens=tokens,
        max_decode_steps=math.ceil(tokens / inflight),
    )
    obs = observations(c, frames)
    clock = device_clock(model.device)
    max_len = max_len_for(c, tokens)
    runs = {m: [] for m in (*MODES, "concurrent")}
    for _ in range(repeats):
        runners = {m: make_runner(m, model, cfg, inflight, max_len) for m in MODES}
        for m, res in run_modes(runners, obs, warmup, replan_every, clock).items():
            runs[m].append(res)
        if procs is not None:
            runs["concurrent"].append(concurrent_round(procs, tokens, frames, warmup))
    if procs is None:
        runs.pop("concurrent")
    reference = runs["isolated"][0]["texts"]
    out = {"tokens": tokens, "inflight": inflight, "period_ms": 1e3 * period}
    out["exact"] = bool(reference) and all(
        r["texts"].get(k) == v for rs in runs.values() for r in rs for k, v in reference.items()
    )
    iso = [statistics.median(r["cycle_s"]) for r in runs["isolated"]]
    for mode, rs in runs.items():
        out[mode] = summarise(rs, c.action_horizon, period)
        cyc = [statistics.median(r["cycle_s"]) for r in rs]
        out[mode]["speedup_vs_isolated"] = harness.ratio(iso, cyc)
        if mode == "concurrent":
            act = statistics.median(statistics.median(r["action_cycle_s"]) for r in rs)
            out[mode]["action_hz"] = c.action_horizon / act
    out["speedup"] = out["unified"]["speedup_vs_isolated"]
    return out


def cycle_host_work(model, tokens: int, inflight: int) -> dict:
    """Per single-process mode: the host work of one cycle in steady state (after as many
    cycles as a request is in flight), counted at the dispatcher (bench/host_work.py)."""
    c = model.cfg
    cfg = LoopConfig(period_s=1e9, narrate_every=1, narration_tokens=tokens,
                     max_decode_steps=math.ceil(tokens / inflight))  # fmt: skip
    warm = math.ceil(tokens / math.ceil(tokens / inflight)) + 1
    obs = observations(c, warm + 1)
    out = {}
    for m in MODES:
        runner = make_runner(m, model, cfg, inflight, max_len_for(c, tokens))
        for f in range(warm):
            runner.cycle(obs[f], f, tick=f)
        seed = host_work.model_seed(model, runner.manager.arena)
        host = host_work.arena_host(runner.manager.arena)
        out[m] = host_work.count(lambda r=runner: r.cycle(obs[warm], warm, tick=warm), seed, host)
    return out


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in (*MODES, "concurrent") if m in rows[0]]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    x = [f"{r['tokens']}x{r['inflight']}" for r in rows]
    for m in modes:
        ax[0].plot(x, [r[m]["cycle_ms"] for r in rows], "o-", label=m)
        ax[1].plot(x, [r[m]["tokens_per_s"] for r in rows], "o-", label=m)
        ax[2].plot(x, [r[m]["latency_ms_p50"] or 0 for r in rows], "o-", label=m)
    for a, t in zip(ax, ("cycle ms", "language tokens/s", "request latency p50 ms"), strict=True):
        a.set_xlabel("tokens per request x requests in flight")
        a.set_title(t)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv):
    p = argparse.ArgumentParser(prog="embodied-kv bench oxygen", description=__doc__.split("\n")[0])
    harness.add_common_args(p)
    p.add_argument("--png", help="write the sweep plot here (default: next to --json)")
    p.add_argument(
        "--no-concurrent", action="store_true", help="leave out the two-process baseline"
    )
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: one row
    p.add_argument("--repeats", type=int, default=0, help="rounds (0: 4 with --quick, else 5)")
    p.add_argument("--frames", type=int, default=0, help="frames a round (0: 8 quick, else 16)")
    return harness.parse(p, argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    env = harness.Environment.start(a, argv)
    model = build_model(get_preset(a.preset), a.device)
    # quick at pi05: one length (its modes run eager there: ~50 s a row on an H100)
    lengths = ((64,) if a.preset == "pi05" else (16, 64)) if a.quick else (16, 64, 256)
    inflight = (4,) if a.quick else (1, 4, 8)
    frames, warmup, repeats = (8, 2, 4) if a.quick else (16, 3, 5)
    frames, repeats = a.frames or frames, a.repeats or repeats
    if a.smoke:
        lengths, inflight, frames, warmup, repeats = (8,), (2,), 5, 1, 1
    harness.progress(env, "model built")
    procs = None
    if not a.no_concurrent:
        procs = ConcurrentTasks.start(
            a.preset, a.device, a.threads, max_len_for(model.cfg, max(lengths))
        )
        harness.progress(env, "concurrent processes started")
    try:
        with torch.no_grad():
            rows = []
            for k in inflight:
                for n in lengths:
                    rows.append(measure(model, n, k, frames, warmup, repeats, procs))
                    harness.progress(env, f"{n} tokens x {k} in flight measured")
    finally:
        if procs is not None:
            procs.stop()
    head = max(rows, key=lambda r: (r["tokens"], r["inflight"]))
    with torch.no_grad():
        work = cycle_host_work(model, head["tokens"], head["inflight"])
    ratios = {
        f"{r['tokens']}x{r['inflight']}/{m}": r[m]["speedup_vs_isolated"]
        for r in rows
        for m in (*MODES, "concurrent")
        if m in r and m != "isolated"
    }
    result = {
        "benchmark": "oxygen",
        "preset": a.preset,
        "quick": a.quick,
        "speedup": head["speedup"],
        "headline_row": {"tokens": head["tokens"], "inflight": head["inflight"]},
        "unified": head["unified"],
        "isolated": head["isolated"],
        "ratios": ratios,
        "exact": all(r["exact"] for r in rows),
        "rows": rows,
        "host_work_per_cycle": work,  # bench/host_work.py: one steady-state cycle per mode
    }
    result = harness.finish(result, env, a.json)
    table = []
    for r in rows:
        for m in (*MODES, "concurrent"):
            if m not in r:
                continue
            s = r[m]
            table.append(
                [
                    r["tokens"],
                    r["inflight"],
                    m,
                    s["cycle_ms"],
                    s["speedup_vs_isolated"],
                    s["action_hz"],
                    s["tokens_per_s"],
                    s["latency_ms_p50"],
                    s["latency_ms_p99"],
                    r["exact"],
                ]
            )
    print_table(
        [
            "tokens",
            "inflight",
            "mode",
            "cycle ms",
            "iso/mode",
            "action Hz",
            "tok/s",
            "lat p50 ms",
            "lat p99 ms",
            "exact",
        ],
        table,
    )
    print(
        f"oxygen [{result['device']}, {a.preset}]: unified/isolated = {head['speedup']:.2f}x "
        f"at {head['tokens']} tokens, {head['inflight']} in flight; exact={result['exact']}"
    )
    if a.json or a.png:
        png = a.png or a.json.rsplit(".", 1)[0] + ".png"
        plot(rows, png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
