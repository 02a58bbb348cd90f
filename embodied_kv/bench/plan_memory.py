"""`embodied-kv bench plan_memory`: plans as the robot makes them, through the engine's
planner memory, KEEP against full recomputation on the world model.

The robot's way (ROS `memory/update`, then `plan_request`): each fact of a world memory
query (world/memory.py: containers with places, movables in containers, then updates)
goes into the engine's segment memory, one fact per segment, and `Engine.plan` asks the
query. Per query the same facts and the same frame go to two engines over one model:
`memory.mode: keep` with KEEP at any size (`keep_min_segments` 0) and `memory.mode:
full`. Reported per mode: one-hop and two-hop accuracy, how often KEEP's answer is full
recomputation's (paired), and the median time from `plan` to the finished answer, twice:
`cold`, the first plan after the facts arrived (KEEP computes the memory's blocks on its
path), and `warm`, the same plan again with every block cached (a robot whose memory
changed little since its last plan).

What it decides: `memory.keep_min_segments`, the memory size under which plans are
prefilled whole (docs/keep.md). `bench keep` measures KEEP at 10-40 segments on its own
stream; this one measures the small memories of `make demo` (2 containers, 2 movables,
one update: 5 facts) and larger ones with `--containers` / `--updates`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from embodied_kv.bench import harness
from embodied_kv.bench.report import print_table
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.eval.runners import world_observation
from embodied_kv.kv.memory import MemoryOp
from embodied_kv.world import memory
from embodied_kv.world.scene import make_scene
from embodied_kv.world.tasks import sample_task

MODES = ("keep", "full")
MAX_CYCLES = 40  # cycles a plan may take to finish (the world's answers take 1-3)


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv bench plan_memory",
                                description=__doc__.split("\n")[0])  # fmt: skip
    harness.add_common_args(p)
    p.add_argument("--queries", type=int, default=200, help="plans per mode (quick: 20)")
    p.add_argument("--containers", type=int, default=2, help="containers and movables each")
    p.add_argument("--updates", type=int, default=1, help="fact updates after the first facts")
    p.add_argument("--seed", type=int, default=0)
    args = harness.parse(p, argv)
    if args.preset != "tiny":
        p.error("the world model is the tiny preset trained on the world: --preset tiny")
    if args.quick:
        args.queries = min(args.queries, 20)
    if args.queries < 2 or args.containers < 2 or args.updates < 0:
        p.error("--queries >= 2, --containers >= 2, --updates >= 0")
    return args


def engine_for(mode: str, device: str, model=None) -> Engine:
    cfg = EngineConfig(preset="world", device=device, memory_mode=mode, history=0,
                       keep_min_segments=0, max_len=1024)  # fmt: skip
    return Engine(cfg, model=model)


def ask(engine: Engine, facts: tuple[str, ...], query: str, obs) -> tuple[str, float, float]:
    """The facts as the memory (reset to episode_start empties the last query's), then the
    plan twice -> (its answer, cold ms, warm ms)."""
    engine.reset()  # episode_start: an empty memory
    for i, fact in enumerate(facts):
        engine.update_memory(MemoryOp.ADD, f"fact-{i}", fact, len(facts))
    said, cold = plan(engine, query, obs)
    again, warm = plan(engine, query, obs)
    if again != said:
        raise RuntimeError(f"the same plan over the same memory answered {said!r}, {again!r}")
    return said, cold, warm


def plan(engine: Engine, query: str, obs) -> tuple[str, float]:
    """One plan request through the control loop -> (its answer, ms to the answer)."""
    engine.observe(obs)
    t = time.perf_counter()
    request_id, refused = engine.plan(query)
    if refused is not None:
        raise RuntimeError(f"plan refused: {refused.reason}")
    for _ in range(MAX_CYCLES):
        for ev in engine.cycle(0).events:
            if ev.request_id == request_id and ev.done:
                return ev.text.strip(), (time.perf_counter() - t) * 1e3
    raise RuntimeError(f"the plan did not finish in {MAX_CYCLES} cycles")


def run(args) -> dict:
    keep = engine_for("keep", args.device)
    engines = {"keep": keep, "full": engine_for("full", args.device, keep.model)}
    size = keep.model.cfg.vision.image_size
    for e in engines.values():
        e.begin_episode()
    rows = {m: {"said": [], "right": {1: [], 2: []}, "cold": [], "warm": []} for m in MODES}
    segments = 0
    for i in range(args.queries):
        rng = np.random.default_rng(args.seed + i)
        scene = make_scene(rng)
        task = sample_task(scene, rng)
        mq = memory.sample_query(rng, 1 + i % 2, args.containers, args.containers, args.updates)
        segments = max(segments, len(mq.facts))
        obs = world_observation(scene, task.instruction, size)
        for mode in MODES[i % 2 :] + MODES[: i % 2]:  # alternate who goes first
            said, cold, warm = ask(engines[mode], mq.facts, mq.query, obs)
            row = rows[mode]
            row["said"].append(said)
            row["right"][mq.hops].append(memory.names_place(said, mq.answer))
            row["cold"].append(cold)
            row["warm"].append(warm)
    same = [a == b for a, b in zip(rows["keep"]["said"], rows["full"]["said"], strict=True)]
    out = {"queries": args.queries, "segments_max": segments, "containers": args.containers,
           "updates": args.updates, "keep_small_memory": keep.planner.small,
           "same_answer": float(np.mean(same)), "modes": {}}  # fmt: skip
    for mode, row in rows.items():
        out["modes"][mode] = {
            "one_hop": float(np.mean(row["right"][1])),
            "two_hop": float(np.mean(row["right"][2])),
            "cold_ms": statistics.median(row["cold"]),
            "warm_ms": statistics.median(row["warm"]),
        }
    k, f = out["modes"]["keep"], out["modes"]["full"]
    out["two_hop_lost"], out["two_hop_lost_se"] = harness.paired_difference(
        rows["full"]["right"][2], rows["keep"]["right"][2])  # fmt: skip
    out["losses"] = [f"KEEP {name} {k[name]:.3f} < full {f[name]:.3f}"
                     for name in ("one_hop", "two_hop") if k[name] < f[name]] + (
        [f"KEEP {w} plan {k[w + '_ms']:.1f} ms > full {f[w + '_ms']:.1f} ms"
         for w in ("cold", "warm") if k[w + "_ms"] > f[w + "_ms"]])  # fmt: skip
    return out


def report(r: dict) -> None:
    print(f"bench plan_memory: {r['queries']} plans per mode over world memories of up to "
          f"{r['segments_max']} facts ({r['containers']} containers and movables, "
          f"{r['updates']} updates), one fact per segment")  # fmt: skip
    f = r["modes"]["full"]
    print_table(["mode", "one-hop", "two-hop", "cold plan ms", "x full", "warm plan ms",
                 "x full"],
                [[m, v["one_hop"], v["two_hop"], v["cold_ms"], f["cold_ms"] / v["cold_ms"],
                  v["warm_ms"], f["warm_ms"] / v["warm_ms"]]
                 for m, v in r["modes"].items()])  # fmt: skip
    print(f"KEEP gave full recomputation's answer {r['same_answer']:.3f} of the time; two-hop "
          f"points lost {100 * r['two_hop_lost']:.1f} +- {100 * r['two_hop_lost_se']:.1f} "
          f"(paired SE)")  # fmt: skip
    print("where KEEP loses: " + ("; ".join(r["losses"]) or "nowhere"))


def main(argv=None) -> int:
    args = parse(argv)
    env = harness.Environment.start(args, argv)
    result = {"bench": "plan_memory", **run(args)}
    report(result)
    harness.finish(result, env, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
