"""`embodied-kv bench oxygen`: unified KV + cross-frame batching vs isolated execution.

Both modes run the same model and weights on the same observation stream in this
process. Every frame spawns one language request of `tokens` tokens:

    isolated: prefill -> actions | prefill -> decode `tokens` steps alone   (each cycle)
    unified:  prefill -> actions | ceil(tokens / inflight) batched steps    (each cycle)

so `inflight` requests from consecutive frames decode together in steady state and
both modes produce the same tokens per cycle. Action frequency is OxyGen's:
action horizon / cycle latency. `exact` is true when every request's text is the
same in both modes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from embodied_kv.bench.report import device_name, print_table, set_cpu_threads, write_json
from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.frame_loop import FrameLoop
from embodied_kv.engine.isolated import IsolatedRunner
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import KVCacheManager
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

CONTROL_HZ = 50.0  # the robot's action rate; a cycle must end within replan_every ticks


def run_mode(runner, observations, warmup: int, replan_every: int, sync):
    """Cycles of one mode -> (finished texts, per-cycle s, wall s, tokens), the last
    three counted after `warmup` cycles."""
    texts, cycle_s = {}, []
    t_start = tokens0 = None
    for f, obs in enumerate(observations):
        if f == warmup:
            sync()
            t_start, tokens0 = time.perf_counter(), runner.manager.counters.tokens
        res = runner.cycle(obs, f, tick=f * replan_every)
        if f >= warmup:
            cycle_s.append(res.cycle_s)
        texts.update({e.request_id: e.text for e in res.events if e.done})
    sync()
    wall = time.perf_counter() - t_start
    return texts, cycle_s, wall, runner.manager.counters.tokens - tokens0


def measure(model, n_tokens: int, inflight: int, frames: int, warmup: int, sync) -> dict:
    c = model.cfg
    replan_every = max(1, c.action_horizon // 2)
    period = replan_every / CONTROL_HZ
    steps = math.ceil(n_tokens / inflight)
    cfg = LoopConfig(
        period_s=1e9, narrate_every=1, narration_tokens=n_tokens, max_decode_steps=steps
    )
    max_len = 64 * math.ceil((c.prefix_tokens_max + n_tokens + 2) / 64)
    obs = [
        synthetic_observation(c, i, f"task {i % 4}: put the block in the bowl")
        for i in range(frames)
    ]

    out = {}
    for mode in ("isolated", "unified"):
        queue = ActionQueue(c.action_horizon, c.action_dim)
        if mode == "unified":
            runner = FrameLoop(KVCacheManager(model, inflight + 2, max_len), queue, cfg)
        else:
            runner = IsolatedRunner(model, queue, cfg, max_len)
        texts, cycles, wall, tokens = run_mode(runner, obs, warmup, replan_every, sync)
        if mode == "unified":
            for e in runner.finish_all():
                if e.done:
                    texts[e.request_id] = e.text
        latency = sum(cycles) / len(cycles)
        out[mode] = {
            "cycle_ms": 1e3 * latency,
            "cycle_hz": 1.0 / latency,
            "action_hz": c.action_horizon / latency,
            "tokens_per_s": tokens / wall,
            "deadline_misses": sum(x > period for x in cycles),
            "texts": texts,
        }
    u, i = out["unified"], out["isolated"]
    exact = all(u["texts"].get(k) == v for k, v in i["texts"].items()) and len(i["texts"]) > 0
    for m in out.values():
        m.pop("texts")
    return {
        "tokens": n_tokens,
        "inflight": inflight,
        "period_ms": 1e3 * period,
        "speedup": i["cycle_ms"] / u["cycle_ms"],
        "exact": exact,
        "unified": u,
        "isolated": i,
    }


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for k in sorted({r["inflight"] for r in rows}):
        rs = [r for r in rows if r["inflight"] == k]
        x = [r["tokens"] for r in rs]
        ax[0].plot(x, [r["speedup"] for r in rs], "o-", label=f"{k} in flight")
        ax[1].plot(x, [r["unified"]["action_hz"] for r in rs], "o-", label=f"unified, {k}")
        ax[2].plot(x, [r["unified"]["tokens_per_s"] for r in rs], "o-", label=f"unified, {k}")
    rs = [r for r in rows if r["inflight"] == rows[0]["inflight"]]
    ax[1].plot(
        [r["tokens"] for r in rs], [r["isolated"]["action_hz"] for r in rs], "k--", label="isolated"
    )
    ax[2].plot(
        [r["tokens"] for r in rs],
        [r["isolated"]["tokens_per_s"] for r in rs],
        "k--",
        label="isolated",
    )
    for a, t in zip(
        ax, ("speedup unified / isolated", "action Hz", "language tokens/s"), strict=True
    ):
        a.set_xscale("log", base=2)
        a.set_xlabel("language tokens per request")
        a.set_title(t)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv bench oxygen", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sweep, < 60 s on a 2-core CPU")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--png", help="write the sweep plot here (default: next to --json)")
    p.add_argument("--allow-cpu-pi05", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (see report.py)")
    a = p.parse_args(argv)
    set_cpu_threads(a.threads)
    if a.preset == "pi05" and a.device == "cpu" and not a.allow_cpu_pi05:
        print("pi05 on the CPU takes hours; use --device cuda or --allow-cpu-pi05", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = build_model(get_preset(a.preset), a.device)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    lengths = (16, 64) if a.quick else (16, 64, 256)
    inflight = (4,) if a.quick else (1, 4, 8)
    frames, warmup = (8, 2) if a.quick else (16, 3)
    rows = [measure(model, n, k, frames, warmup, sync) for k in inflight for n in lengths]
    head = max(rows, key=lambda r: (r["tokens"], r["inflight"]))
    result = {
        "benchmark": "oxygen",
        "device": device_name(a.device),
        "preset": a.preset,
        "quick": a.quick,
        "speedup": head["speedup"],
        "headline_row": {"tokens": head["tokens"], "inflight": head["inflight"]},
        "unified": head["unified"],
        "isolated": head["isolated"],
        "exact": all(r["exact"] for r in rows),
        "rows": rows,
    }
    print_table(
        [
            "tokens",
            "inflight",
            "iso cycle ms",
            "uni cycle ms",
            "speedup",
            "uni action Hz",
            "uni tok/s",
            "iso tok/s",
            "uni misses",
            "iso misses",
            "exact",
        ],
        [
            [
                r["tokens"],
                r["inflight"],
                r["isolated"]["cycle_ms"],
                r["unified"]["cycle_ms"],
                r["speedup"],
                r["unified"]["action_hz"],
                r["unified"]["tokens_per_s"],
                r["isolated"]["tokens_per_s"],
                r["unified"]["deadline_misses"],
                r["isolated"]["deadline_misses"],
                r["exact"],
            ]
            for r in rows
        ],
    )
    print(
        f"oxygen [{result['device']}, {a.preset}]: unified/isolated = {head['speedup']:.2f}x "
        f"at {head['tokens']} tokens, {head['inflight']} in flight; exact={result['exact']}"
    )
    if a.json:
        write_json(result, a.json)
        png = a.png or a.json.rsplit(".", 1)[0] + ".png"
        plot(rows, png)
        print(f"wrote {a.json} and {png}")
    elif a.png:
        plot(rows, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
