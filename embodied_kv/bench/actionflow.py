"""`embodied-kv bench actionflow`: pipelined autoregressive actions vs their baselines.

Three schedulers (engine/pipeline.py) on the same model, weights and frames, in this
process:

    sequential:  prefill, K-1 decode steps, frame after frame
    naive pipe:  ActionFlow's schedule, KV gathered into a fresh buffer every step
    actionflow:  one packed step per frame: prefill(t) + decode(t-1 .. t-K+1) on a ring

Rate is actions per second in steady state (after K warm-up frames fill the pipe, one
for sequential); latency is observation -> decoded action of each frame. The three run
round-robin (bench/harness.py `interleave`), `repeats` times, and the ratios are medians
of per-round ratios, so a burst of load from another process hits all three alike.
Pipelining trades latency for rate, so both are printed. Rows: `bins` over K in
{7, 16, 24, 32} and prefill lengths; a FAST row per cap (variable length: a frame
leaves when complete); and the unified row: language decodes of the manager inside
the pipeline's packed step vs a separate step per cycle. `exact` is true when every
scheduler decodes the same ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from embodied_kv.bench import harness, host_work
from embodied_kv.bench.report import print_table
from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.ar_loop import ARLoop
from embodied_kv.engine.pipeline import SCHEDULERS
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import KVCacheManager
from embodied_kv.model.action_tokens import (
    ActionTokenConfig,
    BinTokenizer,
    action_model_config,
    make_action_tokenizer,
    reserved_tail,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.timing import device_clock

BIN_SHAPES = {7: (1, 7), 16: (2, 8), 24: (3, 8), 32: (4, 8)}  # K -> (steps, dims); 7: OpenVLA
LONG_TASK = "pick up the red block and put it in the blue bowl on the left " * 40
NAMES = ("sequential", "naive_pipe", "actionflow")


def prefixes(model, n: int):
    obs = [synthetic_observation(model.cfg, i, LONG_TASK) for i in range(n)]
    return [model.embed_prefix(o) for o in obs]


def run_scheduler(model, name: str, tok, frames, measured: int, work: dict | None = None):
    """One scheduler over warm-up + `measured` frames -> (steady-state figures, ids).
    `work`: count the steady state's host work (bench/host_work.py) into work[name], per
    action (the figures' timings then include the counter's own cost: report, not time)."""
    k = tok.max_tokens
    warmup = 1 if name == "sequential" else k  # a pipe is full after K frames
    frames = frames[: warmup + measured]
    max_len = 64 * -(-(frames[0].embeds.shape[0] + k + 1) // 64)
    arena = model.new_arena(k + 2, max_len)
    sched = SCHEDULERS[name](model, arena, tok)
    clock = device_clock(model.device)
    done, t0, n0 = [], None, 0
    hw = host_work.HostWork(host_work.model_seed(model, arena), host_work.arena_host(arena))
    for f, p in enumerate(frames):
        if f == warmup:
            t0, n0 = clock(), len(done)
        if work is not None and f >= warmup:
            with hw, hw.region(name):
                done += sched.cycle(p, f, f).done
        else:
            done += sched.cycle(p, f, f).done
    wall = clock() - t0
    counted = done[n0:]
    if work is not None:
        work[name] = hw.counts[name].per(max(1, len(counted)))
    done += sched.drain()
    sched.close()
    lat = np.array([d.latency_s for d in counted])
    row = {
        "actions_per_s": len(counted) / wall,
        "latency_ms": 1e3 * float(lat.mean()),
        "latency_p90_ms": 1e3 * float(np.percentile(lat, 90)),
        "tokens_per_action": float(np.mean([len(d.tokens) for d in done])),
        "invalid": sched.counters.invalid,
    }
    return row, {d.frame: d.tokens for d in done if d.frame < warmup + measured}


def summarise(runs: list[dict]) -> dict:
    """Medians over the repeats, plus the spread of the rate."""
    rate = harness.Stats.of([r["actions_per_s"] for r in runs])
    return {
        "actions_per_s": rate.median,
        "actions_per_s_p10": rate.p10,
        "actions_per_s_p90": rate.p90,
        **{
            key: statistics.median(r[key] for r in runs)
            for key in ("latency_ms", "latency_p90_ms", "tokens_per_action", "invalid")
        },
    }


def compare(model, tok, frames, measured: int, repeats: int, label: dict) -> dict:
    runs: dict[str, list] = {name: [] for name in NAMES}
    fns = {
        name: lambda name=name: runs[name].append(run_scheduler(model, name, tok, frames, measured))
        for name in NAMES
    }
    harness.interleave(fns, model.device, warmup=0, repeats=repeats)
    out = {name: summarise([row for row, _ in runs[name]]) for name in NAMES}
    # ms per action, per round: the harness pairs them round by round
    per_action = {name: [1e3 / row["actions_per_s"] for row, _ in runs[name]] for name in NAMES}
    ids = [i for name in NAMES for _, i in runs[name]]
    work: dict = {}
    for name in NAMES:  # one more run of each, counted: per action
        run_scheduler(model, name, tok, frames, measured, work)
    seq, flow = out["sequential"], out["actionflow"]
    common = sorted(set.intersection(*(set(i) for i in ids)))  # frames every run finished
    return {
        **label,
        "K": tok.max_tokens,
        "prefill_tokens": int(frames[0].embeds.shape[0]),
        "repeats": repeats,
        "fps_vs_sequential": harness.ratio(per_action["sequential"], per_action["actionflow"]),
        "fps_vs_naive": harness.ratio(per_action["naive_pipe"], per_action["actionflow"]),
        "latency_vs_sequential": flow["latency_ms"] / seq["latency_ms"],
        "host_work_per_action": work,
        "exact": len(common) > measured
        and all([i[f] for f in common] == [ids[0][f] for f in common] for i in ids),
        **out,
    }


def unified_row(model, tok, observations, language_tokens: int, repeats: int) -> dict:
    """The ar-mode loop with a narration per frame: language decodes inside the packed
    step (unified) vs one more step per cycle (separate). Same tokens either way."""
    k = tok.max_tokens
    warmup = k + 2
    cfg = LoopConfig(period_s=1e9, narrate_every=1, narration_tokens=language_tokens)
    p = model.embed_prefix(observations[0]).embeds.shape[0]
    max_len = 64 * -(-(p + language_tokens + k + 2) // 64)
    runs: dict[str, list] = {"unified": [], "separate": []}

    def run(mode: str) -> None:
        manager = KVCacheManager(model, k + language_tokens + 4, max_len)
        queue = ActionQueue(tok.horizon, tok.dims)
        loop = ARLoop(manager, queue, cfg, tok, unified=mode == "unified")
        clock = device_clock(model.device)
        chunks, texts = [], {}
        for f, obs in enumerate(observations):
            if f == warmup:
                t0, tok0, act0 = clock(), manager.counters.tokens, len(chunks)
            res = loop.cycle(obs, f, f)
            if res.chunk is not None:
                chunks.append(res.chunk.tobytes())
            texts.update({e.request_id: e.text for e in res.events if e.done})
        wall = clock() - t0
        figures = {
            "cycle_ms": 1e3 * wall / (len(observations) - warmup),
            "actions_per_s": (len(chunks) - act0) / wall,
            "tokens_per_s": (manager.counters.tokens - tok0) / wall,
        }
        texts.update({e.request_id: e.text for e in loop.finish_all() if e.done})
        runs[mode].append((figures, (chunks, texts)))

    harness.interleave(
        {m: lambda m=m: run(m) for m in runs}, model.device, warmup=0, repeats=repeats
    )
    out = {
        m: {key: statistics.median(f[key] for f, _ in rs) for key in rs[0][0]}
        for m, rs in runs.items()
    }
    outputs = [o for rs in runs.values() for _, o in rs]
    return {
        "K": k,
        "language_tokens": language_tokens,
        "repeats": repeats,
        "speedup": harness.ratio(
            [f["cycle_ms"] for f, _ in runs["separate"]],
            [f["cycle_ms"] for f, _ in runs["unified"]],
        ),
        "exact": all(o == outputs[0] for o in outputs),
        **out,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embodied-kv bench actionflow", description=__doc__.split("\n")[0]
    )
    harness.add_common_args(p)
    p.add_argument("--smoke", action="store_true", help="K=7 and one FAST cap (tests)")
    p.add_argument("--repeats", type=int, default=0, help="rounds (0: 3 with --quick, else 5)")
    p.add_argument("--ks", default="", help="bin K values, comma-separated (of 7,16,24,32)")
    p.add_argument("--fast-caps", default=None, help="FAST caps, comma-separated ('': none)")
    p.add_argument("--text-lengths", default="", help="prompt text tokens, comma-separated")
    a = harness.parse(p, argv)
    env = harness.Environment.start(a, argv)
    ks = (7, 16, 32) if a.quick else (7, 16, 24, 32)
    text_lengths = (48,) if a.quick else (48, 176)
    fast_caps = (24,) if a.quick else (16, 32, 48)
    measured = 6 if a.quick else 12
    repeats = a.repeats or (3 if a.quick else 5)
    if a.smoke:
        ks, fast_caps, measured, repeats = (7,), (12,), 3, 1
    ks = tuple(int(k) for k in a.ks.split(",")) if a.ks else ks
    if a.fast_caps is not None:
        fast_caps = tuple(int(c) for c in a.fast_caps.split(",") if c)
    text_lengths = tuple(int(t) for t in a.text_lengths.split(",")) if a.text_lengths else (
        text_lengths)  # fmt: skip
    if bad := [k for k in ks if k not in BIN_SHAPES]:
        p.error(f"--ks {bad}: use of {sorted(BIN_SHAPES)}")

    rows = []
    for text in text_lengths:
        base = get_preset(a.preset, max_text_tokens=text)
        model = build_model(action_model_config(base, 1024), a.device)
        frames = prefixes(model, max(ks + fast_caps) + measured)
        for k in ks:
            steps, dims = BIN_SHAPES[k]
            tok = BinTokenizer(model.cfg.vocab_size, steps, dims, reserved_tail(model.cfg))
            rows.append(compare(model, tok, frames, measured, repeats, {"tokens": "bins"}))
    for cap in fast_caps:
        acfg = ActionTokenConfig("fast", horizon=model.cfg.action_horizon, max_tokens=cap)
        tok = make_action_tokenizer(acfg, model.cfg, model.tokenizer)
        rows.append(compare(model, tok, frames, measured, repeats, {"tokens": "fast"}))

    dims = model.cfg.action_dim  # the unified row runs the ar loop: whole robot actions
    tok = BinTokenizer(model.cfg.vocab_size, 1, dims, reserved_tail(model.cfg))
    obs = [synthetic_observation(model.cfg, i, "put the block in the bowl") for i in range(20)]
    unified = unified_row(model, tok, obs, language_tokens=8, repeats=repeats)

    head = next(r for r in rows if r["tokens"] == "bins" and r["K"] == 7)
    result = harness.finish(
        {
            "benchmark": "actionflow",
            "preset": a.preset,
            "quick": a.quick,
            "fps_vs_sequential_k7": head["fps_vs_sequential"],
            "fps_vs_naive_k7": head["fps_vs_naive"],
            "exact": all(r["exact"] for r in rows) and unified["exact"],
            "rows": rows,
            "unified": unified,
        },
        env,
        a.json,
    )
    print_table(
        ["tokens", "K", "prefill", "seq act/s", "naive act/s", "flow act/s", "x seq",
         "x naive", "seq lat ms", "naive lat ms", "flow lat ms", "tok/act", "exact"],
        [
            [r["tokens"], r["K"], r["prefill_tokens"], r["sequential"]["actions_per_s"],
             r["naive_pipe"]["actions_per_s"], r["actionflow"]["actions_per_s"],
             r["fps_vs_sequential"], r["fps_vs_naive"], r["sequential"]["latency_ms"],
             r["naive_pipe"]["latency_ms"], r["actionflow"]["latency_ms"],
             r["actionflow"]["tokens_per_action"], r["exact"]]
            for r in rows
        ],
    )  # fmt: skip
    u = unified
    print(
        f"unified step (K={u['K']}, narration of {u['language_tokens']} tokens per frame): "
        f"cycle {u['unified']['cycle_ms']:.1f} ms vs separate steps "
        f"{u['separate']['cycle_ms']:.1f} ms = {u['speedup']:.2f}x; "
        f"{u['unified']['tokens_per_s']:.0f} vs {u['separate']['tokens_per_s']:.0f} tokens/s; "
        f"exact={u['exact']}"
    )
    print(
        f"actionflow [{result['device']}, {a.preset}, median of {repeats}]: K=7 "
        f"{head['fps_vs_sequential']:.2f}x actions/s vs sequential, {head['fps_vs_naive']:.2f}x "
        f"vs naive pipe, latency {head['latency_vs_sequential']:.2f}x; "
        f"exact={result['exact']}; {result['environment']['wall_s']:.0f} s"
    )
    if a.json:
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
