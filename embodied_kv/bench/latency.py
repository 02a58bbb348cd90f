"""`embodied-kv bench latency`: one action's latency, camera images to action chunk, as the
engine's control cycle measures it, next to the arithmetic limit (bench/limit.py).

`CycleResult.action_s` (engine/frame_loop.py): from the start of the cycle to the chunk in
the action queue, on the device clock (CUDA synchronized): the vision tower, the prefix
embedding, the one prefill, the 10 Euler steps of the action expert and the chunk's copy
to the host. No language request runs (narration off), so nothing else shares the cycle.

    graphs  the product's path: Engine with CUDA graphs (vision per camera count, step
            buckets, one denoise graph per slot and row bucket), captured at warmup.
            On a CPU the same graph code in emulation (replay = calling the function).
    graphs_alt  (on CUDA, or --unfused-row) the same with the expert's other layer-step:
            the fused path (model/expert_step.py: the five fused kernels' work as persistent
            launches, one an Euler step with model/expert.py PERSISTENT_EULER_STEP) where
            the product runs the chain (8 kernels a layer-step; FUSED_LAYER_STEP), or the
            chain where it runs the fused path; rows carry `graphs_fused_ms`,
            `graphs_unfused_ms` and `unfused_over_fused`: which one wins on this GPU.
    graphs_prev (with graphs_alt) the product's path without the changes no GPU has timed
            yet (RoPE inside the expert's attention; the backbone's RoPE + K/V store and
            residual add + RMSNorm kernels; the prefill tile's key splits): the ops as
            2026-12-04's H200 ran them; rows carry `graphs_prev_ms` and `prev_over_graphs`
            (> 1: the changes pay). graphs_unsplit: only the key splits off
            (`graphs_unsplit_ms`, `unsplit_over_graphs`); graphs_noprefetch: only the
            expert's weight prefetch into L2 off (`noprefetch_over_graphs`).
    eager   the same engine and weights with graphs off: every op launched from Python,
            as LeRobot's `select_action` runs pi0.5.

Rounds alternate the two engines (one cycle of each per round), per camera count; the
ratio is the median over rounds of eager / graphs. At pi05 on CUDA each row carries two limits:
the one of the prefix rows it measured (`limit_ms`, `graphs_over_limit`: what the verdict
quotes, goal <= 1.5x) and the one of the published 48-text-token prompt (`limit_48_text_ms`,
`graphs_over_limit_48_text`); a byte-level prompt makes the measured prefix longer.

--peer lerobot: LeRobot's `PI05Policy` (the pinned release, bench/lerobot_peer.py) at the
same dims, weights and prefix, `predict_action_chunk` timed in the same rounds (eager; with
--peer-compile MODE also under its `torch.compile` option), and its chunk against ours for
the same noise. Where LeRobot cannot be imported the result says why and the rest runs.

--frames HxW: also the graphs engine fed the cameras' uint8 frames of that size
(`graphs_frames`: CameraFrames, converted and resized on the device inside the cycle, as
`embodied-kv serve` feeds it), against the same engine fed converted images: camera
frames to chunk, the conversion included.

--breakdown: afterwards, a separate pass over the graphs engine times each region of the
action (vision, prefix embedding, prefill, denoise, host): bench/latency_breakdown.py.
--kernels: then a profiler pass, the top kernels by device time: bench/kernel_profile.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np
import torch

from embodied_kv.bench import (
    harness,
    kernel_profile,
    latency_breakdown,
    latency_report,
    lerobot_peer,
    limit,
)
from embodied_kv.engine.config import EngineConfig
from embodied_kv.engine.engine import Engine
from embodied_kv.kernels import expert_attention as attention_kernels
from embodied_kv.kernels import fallback, prefill_tile
from embodied_kv.kernels.expert_attention import REDUCE
from embodied_kv.kernels.prefill_tile import KEY_SPLITS
from embodied_kv.model.camera_frames import CameraFrames
from embodied_kv.model.config import get_preset
from embodied_kv.model.expert import FUSED_LAYER_STEP
from embodied_kv.model.rtc import GUIDANCE, RTCConfig
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import Observation, build_model

GOAL_X_LIMIT = 1.5
KERNEL_CYCLES = 5  # control cycles under the profiler, per camera count (--kernels)
INSTRUCTION = "pick up the cup"  # short: the published limit is for a 48-token prompt


def engine_for(model, mode: str, slots: int, rtc: RTCConfig | None = None) -> Engine:
    cfg = EngineConfig(
        preset=model.cfg.name, device=str(model.device), num_slots=slots, narrate_every=0,
        history=0, auto_episode_capsule=False, control_hz=1e-3,  # no deadline: none missed
        rtc=rtc or RTCConfig(),
    )  # fmt: skip
    return Engine(cfg, model=model, graph_mode=mode)


def observation(cfg, cams: int, seed: int):
    """A synthetic observation with the first `cams` cameras present."""
    mask = tuple(i < cams for i in range(cfg.num_cameras))
    return synthetic_observation(cfg, seed, INSTRUCTION, mask)


def camera_frames(obs, hw: tuple[int, int], seed: int) -> Observation:
    """`obs` with its present cameras as uint8 frames of `hw` pixels (seeded noise: the
    content does not change the time), converted by the model inside the cycle."""
    rng = np.random.default_rng(seed)
    size = obs.images.shape[-1]
    mask = obs.camera_mask or (True,) * obs.images.shape[0]
    frames = [rng.integers(0, 256, (*hw, 3), dtype=np.uint8) if m else None for m in mask]
    return dataclasses.replace(obs, images=CameraFrames(frames, size))


def limit_fields(cams: int, prefix_len: int, graphs_ms: float | None) -> dict:
    """The limits of one row and the measured latency over each (None where not judged):
    at the rows the run prefilled, and at the published 48-text-token prompt."""
    if graphs_ms is None:
        keys = ("limit_ms", "graphs_over_limit", "limit_48_text_ms", "graphs_over_limit_48_text")
        return dict.fromkeys(keys) | {"limit_rows": None}
    at_rows = limit.limit_ms(cams, prefix_len)
    at_48 = limit.limit_ms(cams, limit.prefix_rows(cams))
    return {
        "limit_rows": prefix_len, "limit_ms": at_rows, "graphs_over_limit": graphs_ms / at_rows,
        "limit_48_text_ms": at_48, "graphs_over_limit_48_text": graphs_ms / at_48,
    }  # fmt: skip


def measure(
    model, engines: dict[str, Engine], cams: int, warmup: int, repeats: int, peers=None,
    frames: tuple[int, int] | None = None,
) -> dict:
    """action_s samples (ms) per engine, and per peer (lerobot_peer.LeRobotPeer: its
    `predict_action_chunk`), for observations with `cams` cameras present; with `frames`
    also `graphs_frames` (the graphs engine fed camera frames of that size); the order
    rotates every round."""
    peers = peers if peers is not None else {}
    variants = ["graphs_frames"] if frames else []
    samples = {name: [] for name in [*engines, *variants, *peers]}
    prefix, failed = None, {}
    for r in range(warmup + repeats):
        obs = observation(model.cfg, cams, 1000 * cams + r)
        names = list(samples)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in peers:
                try:
                    ms = peers[name].act_ms(peers[name].batch(obs))
                except Exception as e:  # noqa: BLE001 - the peer's failure ends its rows only
                    failed[name] = f"{type(e).__name__}: {e}"
                    del peers[name], samples[name]
                    continue
                if r >= warmup:
                    samples[name].append(ms)
                continue
            engine = engines["graphs" if name == "graphs_frames" else name]
            model.graphs = engine.graphs  # the engines share the model (and its weights)
            configure(model, name)
            engine.observe(camera_frames(obs, frames, r) if name == "graphs_frames" else obs)
            res = engine.cycle(engine.frame * engine.cfg.replan_every)
            prefix = res.prefix_len
            if r >= warmup:
                samples[name].append(res.action_s * 1e3)
    return {"prefix_len": prefix, "samples": samples, "failed": failed}


def layer_step(engine: str) -> bool:
    """The engine's `fused_layer_step`: the product's, or the other one for graphs_alt."""
    return FUSED_LAYER_STEP != (engine == "graphs_alt")


def configure(model, engine: str) -> None:
    """The model's switches as `engine` runs (and captured) it: the expert's layer-step, and
    for graphs_prev the untimed fusions off (model/expert.py rope_in_attention,
    model/backbone.py fused_epilogues, the expert attention's persistent queue, the weight
    prefetch); graphs_noprefetch: only the prefetch off (model/weight_prefetch.py)."""
    model.expert.fused_layer_step = layer_step(engine)
    model.expert.prefetch_weights = engine not in ("graphs_prev", "graphs_noprefetch")
    model.expert.rope_in_attention = model.backbone.fused_epilogues = engine != "graphs_prev"
    attention_kernels.REDUCE = "launch" if engine == "graphs_prev" else REDUCE
    prefill_tile.KEY_SPLITS = 1 if engine in ("graphs_prev", "graphs_unsplit") else KEY_SPLITS


def run(args, env: harness.Environment) -> dict:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    depth = args.layers or None  # reduced depth: the code path at real widths on a CPU
    cfg = get_preset(args.preset, depth, depth)
    model = build_model(cfg, args.device, dtype)
    mode = "cuda" if args.device == "cuda" else "emulate"
    engines = {"graphs": engine_for(model, mode, 2), "eager": engine_for(model, "off", 2)}
    unfused = args.device == "cuda" or args.unfused_row
    if unfused:
        engines["graphs_alt"] = engine_for(model, mode, 2)
        engines["graphs_prev"] = engine_for(model, mode, 2)
        engines["graphs_unsplit"] = engine_for(model, mode, 2)
        engines["graphs_noprefetch"] = engine_for(model, mode, 2)
    if args.rtc:  # the guided loop from its graph (docs/rtc.md); guided from its 2nd chunk on
        rtc = RTCConfig(enabled=True, guidance=args.rtc)
        engines["graphs_rtc"] = engine_for(model, mode, 2, rtc)
    obs = synthetic_observation(cfg, 0, INSTRUCTION)
    for name, e in engines.items():
        model.graphs = e.graphs
        configure(model, name)  # captured as it is now
        e.observe(obs)
        e.warmup()  # captures every graph (configure time); nothing is captured after
        e.begin_episode()
    harness.progress(env, f"engines warm, {engines['graphs'].graphs.captures} graphs captured")
    repeats = args.repeats or (10 if args.quick else 40)
    cams_list = [c for c in range(1, cfg.num_cameras + 1) if args.preset != "pi05" or c >= 2]
    if args.cameras:
        cams_list = [c for c in cams_list if c in args.cameras]
    rows = []
    peer_reason = lerobot_peer.why_not(cfg) if args.peer else None
    peers, peer_build = {}, {}
    if args.peer and peer_reason is None:
        try:  # LeRobot's failure is reported; our rows run on
            peers, peer_build = build_peers(model, cams_list[0], args.peer_compile, env)
        except Exception as e:  # noqa: BLE001
            peer_reason = peer_failed("building", e)
    for cams in cams_list:
        peer_fields = {}
        if peers:
            try:
                peer_fields = peer_row(peers, cams, model)
            except Exception as e:  # noqa: BLE001
                peer_reason, peers = peer_failed(f"at {cams} cameras", e), {}
        m = measure(model, engines, cams, warmup=2, repeats=repeats, peers=peers,
                    frames=args.frames)  # fmt: skip
        if m["failed"]:
            peer_reason = f"failed at {cams} cameras: {m['failed']}"
            print(f"LeRobot's peer {peer_reason}", file=sys.stderr)
        harness.progress(env, f"{cams} cameras measured")
        g, e = m["samples"]["graphs"], m["samples"]["eager"]
        real = args.preset == "pi05" and args.device == "cuda" and not args.layers
        gm = statistics.median(g)
        rows.append({
            "cameras": cams, "prefix_len": m["prefix_len"],
            "graphs_ms": harness.Stats.of(g).as_dict(), "eager_ms": harness.Stats.of(e).as_dict(),
            "eager_over_graphs": harness.ratio(e, g),
            **limit_fields(cams, m["prefix_len"], gm if real else None),
            "captures": engines["graphs"].graphs.captures,
        })  # fmt: skip
        if unfused:
            a = m["samples"]["graphs_alt"]
            f, u = (g, a) if FUSED_LAYER_STEP else (a, g)
            rows[-1] |= {"graphs_fused_ms": harness.Stats.of(f).as_dict(),
                         "graphs_unfused_ms": harness.Stats.of(u).as_dict(),
                         "unfused_over_fused": harness.ratio(u, f),
                         "layer_step": "fused" if FUSED_LAYER_STEP else "unfused"}  # fmt: skip
            for name in ("prev", "unsplit", "noprefetch"):
                p = m["samples"][f"graphs_{name}"]
                rows[-1] |= {f"graphs_{name}_ms": harness.Stats.of(p).as_dict(),
                             f"{name}_over_graphs": harness.ratio(p, g)}  # fmt: skip
        ours = g if mode == "cuda" else e  # the product's path: graphs on CUDA, eager on a CPU
        for name in peers:
            p = m["samples"][name]
            rows[-1] |= {f"{name}_ms": harness.Stats.of(p).as_dict(),
                         f"{name}_over_ours": harness.ratio(p, ours)}  # fmt: skip
        rows[-1] |= peer_fields
        if args.frames:
            f = m["samples"]["graphs_frames"]
            rows[-1] |= {"frames_hw": list(args.frames),
                         "graphs_frames_ms": harness.Stats.of(f).as_dict(),
                         "frames_over_graphs": harness.ratio(f, g)}  # fmt: skip
        if args.rtc:
            r = m["samples"]["graphs_rtc"]
            rows[-1] |= {"rtc": args.rtc, "graphs_rtc_ms": harness.Stats.of(r).as_dict(),
                         "rtc_over_graphs": harness.ratio(r, g)}  # fmt: skip
    if args.breakdown:  # after the headline rounds: its syncs stay out of them
        for row in rows:
            cams, n = row["cameras"], 2 + repeats
            obs = (observation(cfg, cams, 1000 * cams + 500 + r) for r in range(n))
            medians, action = latency_breakdown.breakdown(model, engines["graphs"], obs, 2)
            row.update(breakdown_ms=medians, breakdown_action_ms=action)
            harness.progress(env, f"{cams} cameras broken down")
    if args.kernels:
        for row in rows:
            cams = row["cameras"]
            obs = [observation(cfg, cams, 1000 * cams + 700 + r) for r in range(KERNEL_CYCLES)]
            row["kernels"] = kernel_profile.top_kernels(model, engines["graphs"], obs)
            harness.progress(env, f"{cams} cameras profiled")
    model.graphs = None
    configure(model, "graphs")
    peer = None
    if args.peer:
        peer = {"name": args.peer, "pinned": lerobot_peer.PINNED, "unavailable": peer_reason,
                "compile_mode": args.peer_compile, "ours": "graphs" if mode == "cuda" else "eager",
                **peer_build}  # fmt: skip
    peers.clear()
    return {
        "benchmark": "latency", "preset": args.preset, "dtype": str(dtype).split(".")[-1],
        "graph_mode": mode, "repeats": repeats, "rows": rows, "goal_x_limit": GOAL_X_LIMIT,
        "peer": peer, "kernels_off": dict(fallback.OFF),
        "queue_timeouts": model.expert.workspaces.timed_out(),  # persistent kernels' waits
    }  # fmt: skip


def peer_failed(where: str, e: Exception) -> str:
    """The reason recorded when LeRobot's peer raised; its traceback goes to stderr."""
    import traceback

    traceback.print_exc()
    return f"failed {where}: {type(e).__name__}: {e}"


def build_peers(model, cams: int, compile_mode: str | None, env) -> tuple[dict, dict]:
    """LeRobot's policies (eager; compiled with `compile_mode`), built once for the run ->
    (peers, the seconds each build and the compiled one's first call took)."""
    t = time.perf_counter()
    peers = {"lerobot": lerobot_peer.LeRobotPeer(model, cams)}
    took = {"build_s": round(time.perf_counter() - t, 1), "built_on": peers["lerobot"].built_on}
    if compile_mode:
        compiled = lerobot_peer.LeRobotPeer(model, cams, compile_mode)
        t = time.perf_counter()
        compiled.act_ms(compiled.batch(observation(model.cfg, cams, 8)))  # compiles
        took["compiled_first_call_s"] = round(time.perf_counter() - t, 1)
        took["compiled_matmul_precision"] = compiled.matmul_precision
        peers["lerobot_compiled"] = compiled
    harness.progress(env, "LeRobot's PI05Policy built")
    return peers, took


def peer_row(peers: dict, cams: int, model) -> dict:
    """The peers set to `cams` cameras; the row's fields measured once: LeRobot's prefix
    rows and its chunk against ours for the same observation and noise."""
    for p in peers.values():
        p.set_cameras(cams)
    eager = peers["lerobot"]
    return {"lerobot_prefix_rows": eager.prefix_rows(),
            "lerobot_vs_ours": lerobot_peer.agreement(eager, observation(model.cfg, cams, 9))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embodied-kv bench latency", description=__doc__.split("\n")[0]
    )
    harness.add_common_args(p)
    p.add_argument("--repeats", type=int, default=0, help="rounds per camera count (0: 10 / 40)")
    p.add_argument("--layers", type=int, default=0, help="depth override (0: the preset's)")
    p.add_argument("--unfused-row", action="store_true",
                   help="add the graphs engine with the expert's other layer-step (fused "
                        "kernels or the chain; on by default on CUDA; on a CPU both run the "
                        "same reference chain)")  # fmt: skip
    p.add_argument(
        "--breakdown", action="store_true",
        help="then time each region of one action on the graphs engine (a separate pass)",
    )  # fmt: skip
    p.add_argument(
        "--rtc",
        choices=GUIDANCE,
        default=None,
        help="also an engine with real-time chunking (this guidance): its own row",
    )
    p.add_argument("--cameras", type=lambda t: [int(c) for c in t.split(",")], default=None,
                   help="only these camera counts, e.g. 2 (default: every count; pi05: 2, 3)")
    p.add_argument("--frames", type=_hw, default=None, metavar="HxW",
                   help="also the graphs engine fed uint8 camera frames of this size, e.g. "
                   "480x640 (converted on the device inside the cycle): its own row")
    p.add_argument("--kernels", action="store_true",
                   help="then profile a few cycles: the top kernels by device time")
    p.add_argument("--peer", choices=["lerobot"], default=None,
                   help="also time LeRobot's PI05Policy (pinned, bench/lerobot_peer.py) in the "
                   "same rounds (needs lerobot importable: Python >= 3.12, docs/gpu.md)")
    p.add_argument("--peer-compile", metavar="MODE", default=None,
                   help="and LeRobot's policy under torch.compile with this mode (its "
                   "compile_model option), e.g. default or max-autotune")  # fmt: skip
    args = harness.parse(p, argv)
    if args.peer_compile and not args.peer:
        p.error("--peer-compile needs --peer lerobot")
    return harness.execute(args, argv, run, latency_report.report)


def _hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HxW, e.g. 480x640") from None
    if min(h, w) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sides must be >= 1")
    return h, w


if __name__ == "__main__":
    sys.exit(main())
