"""`embodied-kv bench serve`: what openpi's websocket protocol costs on this engine, and
how many actions per second several clients get, beside openpi's own server design.

    overhead    one client, sequential frames (openpi's LIBERO layout: two 224 x 224
                images, the robot's state, a prompt). Per request: the server's time
                from frame in hand to reply sent (server_timing), minus the engine's own
                action latency (prefill start -> chunk, CycleResult.action_s) and minus
                the server's msgpack of that frame and that reply as the server timed
                them in place (server_timing unpack_ms, prev_pack_ms: a cold frame's
                unpack costs several times a warm loop's, which is also reported). What
                is left is the server's: the layout's checks, the cycle's tail, the
                websocket send (a loopback syscall that wakes the client: ~0.13 ms).
                The images' conversion is the model's, inside the action latency
                (camera frames -> chunk: model/camera_frames.py), as openpi's server
                times its input transforms inside infer_ms; reported apart
                (`serialisation_ms.image_conversion_in_engine`, warm loop). Also
                against the same frame handled by a direct call (ServePolicy.handle,
                no socket): the socket path alone. Goal: <= 0.5 ms (the issue's, on this CPU).
    throughput  N = 1, 2, 4 clients, back to back for a fixed time (in rounds, the
                designs' order rotating, as the overhead rounds) -> actions/s, for
                ours (one engine, N connections), openpi's design with one server and N
                clients (the event loop blocked during inference, openpi #717), and
                openpi's scaling answer, one server with its own model per client.

Servers run in this process (bench/serve_servers.py), each started by a thread of its own
(ours: websockets' synchronous server, a thread per connection; openpi's: an event loop),
with its own engine built as `embodied-kv serve` builds it (config/robot.yaml, narration
and history off; torch 1 thread); clients run in worker processes, as robots would.
The per-client servers are threads of one process here, not processes: they share the
GIL, so their row is a lower bound for separate processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from embodied_kv.bench import harness, serve_clients
from embodied_kv.bench.report import print_table
from embodied_kv.bench.serve_servers import OpenpiDesignServer, ServerThread
from embodied_kv.config_file import default_config_path, load_params
from embodied_kv.engine.startup import start_engine
from embodied_kv.serve import wire
from embodied_kv.serve.config import ServeConfig, serve_engine_config
from embodied_kv.serve.policy import ServePolicy
from embodied_kv.serve.server import PolicyServer
from embodied_kv.serve.session import Session

GOAL_OVERHEAD_MS = 0.5  # issue #36: per request beyond the engine and serialisation
CLIENTS = (1, 2, 4)
PROMPT = "put the red block in the box"


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["tiny", "world"], default="tiny",
                   help="tiny (random weights, fast) or world (the shipped weights)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="< 60 s on a 2-core CPU")
    p.add_argument("--json", metavar="PATH", help="write the result (and its environment) here")
    p.add_argument("--rounds", type=int, help="overhead and throughput rounds (default 5; quick 3)")
    p.add_argument("--requests", type=int, help="requests per design a round (20; quick 12)")
    p.add_argument("--seconds", type=float, help="per throughput row (5; quick 1.5)")
    args = p.parse_args(argv)
    quick = (3, 12, 1.5) if args.quick else (5, 20, 5.0)
    args.rounds = args.rounds or quick[0]
    args.requests = args.requests or quick[1]
    args.seconds = args.seconds or quick[2]
    if min(args.rounds, args.requests) < 1 or args.seconds <= 0:
        p.error(f"--rounds {args.rounds}, --requests {args.requests} >= 1, --seconds > 0")
    args.device, args.threads = "cpu", 1  # what harness.Environment records
    return args


def libero_frame(state_dim: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.uniform(-0.5, 0.5, state_dim),
        "prompt": PROMPT,
    }


def serialisation_ms(msg: dict, reply: dict, repeats: int) -> dict[str, float]:
    """msgpack of the arrays, per side: the server unpacks the frame and packs the reply
    (serve/wire.py), the client packs the frame and unpacks the reply (openpi-client's
    msgpack_numpy)."""
    from openpi_client import msgpack_numpy

    frame, packed = msgpack_numpy.Packer().pack(msg), wire.pack(reply)
    server, client = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        wire.unpack(frame)
        wire.pack(reply)
        t1 = time.perf_counter()
        msgpack_numpy.Packer().pack(msg)
        msgpack_numpy.unpackb(packed)
        t2 = time.perf_counter()
        server.append((t1 - t) * 1e3)
        client.append((t2 - t1) * 1e3)
    return {"server": statistics.median(server), "client": statistics.median(client)}


def conversion_ms(policy: ServePolicy, msg: dict, repeats: int) -> float:
    """The two images' conversion to the model's input as the engine does it on this
    device (inside its action latency), in a warm loop: median ms."""
    times = []
    for _ in range(repeats):
        frames = policy.observation(msg).images  # new frames: none converted yet
        t = time.perf_counter()
        frames.to_input(frames.present(), policy.engine.model.device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def overhead(pool, ports: dict[str, int], policy: ServePolicy, msg: dict, rounds: int,
             k: int) -> dict:  # fmt: skip
    """Interleaved rounds of k sequential requests per design, and k direct calls."""
    rows: dict[str, list[dict]] = {name: [] for name in [*ports, "direct"]}
    names = list(rows)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == "direct":
                session = Session()
                for _ in range(k):
                    t = time.perf_counter()
                    reply = policy.handle(session, msg)
                    ms = (time.perf_counter() - t) * 1e3
                    policy.after_reply(session)  # as the servers do, after the reply
                    rows[name].append({"rtt_ms": ms, "action_ms": reply["action_latency_ms"]})
            else:
                rows[name] += pool.submit(serve_clients.requests, ports[name], msg, k).result()
    return rows


def throughput(pool, servers: dict, msg: dict, seconds: float, rounds: int) -> list[dict]:
    """servers: design -> (N -> the ports its N clients use). Per N, `rounds` rounds of
    seconds / rounds per design, the designs' order rotating each round (as the harness
    interleaves repeats), so a slow spell of a shared machine falls on every design."""
    out = []
    window = seconds / rounds
    for n in CLIENTS:
        designs = [d for d, ports_for in servers.items() if ports_for(n) is not None]
        chunks = dict.fromkeys(designs, 0)
        for r in range(rounds):
            for design in designs[r % len(designs) :] + designs[: r % len(designs)]:
                start_at = time.time() + 0.5 + 0.15 * n  # every client connected and warm first
                futures = [pool.submit(serve_clients.for_seconds, port, msg, start_at, window)
                           for port in servers[design](n)]  # fmt: skip
                chunks[design] += sum(f.result() for f in futures)
        out += [{"design": d, "clients": n, "chunks_per_s": chunks[d] / seconds} for d in designs]
    return out


def main(argv=None) -> int:
    args = parse(argv)
    env = harness.Environment.start(args, argv)
    # client workers forked first: before any server thread or torch op exists here
    pool = ProcessPoolExecutor(max(CLIENTS), mp_context=multiprocessing.get_context("fork"))
    list(pool.map(time.sleep, [0.1] * max(CLIENTS)))
    params = load_params(default_config_path()).with_overrides(preset=args.preset)
    engine_cfg = serve_engine_config(params)
    cfg = ServeConfig(port=0, layout="libero")
    harness.progress(env, f"building {2 + max(CLIENTS) - 1} engines ({args.preset})")
    engines = [start_engine(engine_cfg, lambda line: None) for _ in range(1 + max(CLIENTS))]
    policies = [ServePolicy(e, cfg) for e in engines]
    ours = ServerThread(PolicyServer(policies[0], cfg, lambda line: None), "ours")
    openpi = [ServerThread(OpenpiDesignServer(p, cfg), f"openpi-{i}")
              for i, p in enumerate(policies[1:])]  # fmt: skip
    engine = engines[0]
    msg = libero_frame(engine.robot.state_dim)
    horizon = engine.model.cfg.action_horizon
    try:
        rounds, k, seconds = args.rounds, args.requests, args.seconds
        harness.progress(env, f"overhead: {rounds} rounds x {k} requests per design")
        ports = {"ours": ours.port, "openpi": openpi[0].port}
        rows = overhead(pool, ports, ServePolicy(engines[1], cfg), msg, rounds, k)
        reply = policies[0].handle(Session(), msg) | {"server_timing": {"infer_ms": 1.0}}
        serial = serialisation_ms(msg, reply, 50 if args.quick else 200)
        serial["image_conversion_in_engine"] = conversion_ms(policies[0], msg, 50)
        harness.progress(env, f"throughput: {CLIENTS} clients, {seconds} s each")
        tput = throughput(pool, {
            "ours": lambda n: [ours.port] * n,
            "openpi, one server": lambda n: [openpi[0].port] * n,
            "openpi, a server per client": lambda n: None if n == 1 else
                [s.port for s in openpi[:n]],
        }, msg, seconds, rounds)  # fmt: skip
    finally:
        ours.stop()
        for s in openpi:
            s.stop()
        pool.shutdown()
    result = summarise(rows, serial, tput, horizon, args)
    report(result)
    harness.finish(result, env, args.json)
    return 0


def summarise(rows: dict, serial: dict, tput: list[dict], horizon: int, args) -> dict:
    direct = statistics.median(r["rtt_ms"] for r in rows["direct"])
    over = {}
    for name, samples in rows.items():
        rtt = statistics.median(r["rtt_ms"] for r in samples)
        o = {
            "requests": len(samples),
            "rtt_ms": rtt,
            "action_latency_ms": statistics.median(r["action_ms"] for r in samples),
        }
        if name == "direct":  # the layout's conversion and the cycle's tail
            o["handle_beyond_engine_ms"] = statistics.median(
                r["rtt_ms"] - r["action_ms"] for r in samples
            )
        else:
            o["server_overhead_ms"] = statistics.median(
                r["server_ms"] - r["action_ms"] - r["server_msgpack_ms"] for r in samples)
            o["server_msgpack_in_place_ms"] = statistics.median(
                r["server_msgpack_ms"] for r in samples)
            o["client_path_ms"] = (
                statistics.median(r["rtt_ms"] - r["server_ms"] for r in samples) - serial["client"]
            )
            o["rtt_beyond_direct_call_ms"] = rtt - direct - serial["server"] - serial["client"]
        over[name] = o
    by = {(t["design"], t["clients"]): t["chunks_per_s"] for t in tput}
    for t in tput:
        t["actions_per_s"] = t["chunks_per_s"] * horizon
        t["ours_over_this"] = by[("ours", t["clients"])] / t["chunks_per_s"]
    ours = over["ours"]["server_overhead_ms"]
    return {
        "bench": "serve",
        "preset": args.preset,
        "quick": args.quick,
        "layout": "libero: two 224x224 uint8 images, state, prompt",
        "action_horizon": horizon,
        "serialisation_ms": serial,
        "overhead": over,
        "throughput": tput,
        "goal_overhead_ms": GOAL_OVERHEAD_MS,
        "overhead_goal_met": ours <= GOAL_OVERHEAD_MS,
        "losses": [f"{t['design']}, {t['clients']} clients: ours {t['ours_over_this']:.2f}x"
                   for t in tput if t["design"] != "ours" and t["ours_over_this"] < 1.0]
                  + ([f"server overhead {ours:.2f} ms vs openpi's design "
                      f"{over['openpi']['server_overhead_ms']:.2f} ms"]
                     if ours > over["openpi"]["server_overhead_ms"] else []),
    }  # fmt: skip


def report(r: dict) -> None:
    ser = r["serialisation_ms"]
    print(f"bench serve ({r['preset']}, {r['layout']}); msgpack of the arrays in a warm "
          f"loop: server {ser['server']:.3f} ms, client {ser['client']:.3f} ms; the server's "
          f"in place (cold, subtracted from its overhead): ours "
          f"{r['overhead']['ours']['server_msgpack_in_place_ms']:.3f} ms; the images' "
          f"conversion, inside the engine's action latency (warm loop): "
          f"{ser['image_conversion_in_engine']:.3f} ms")  # fmt: skip
    o = r["overhead"]
    rows = [[name, o[name]["requests"], o[name]["rtt_ms"], o[name]["action_latency_ms"],
             o[name]["server_overhead_ms"], o[name]["client_path_ms"],
             o[name]["rtt_beyond_direct_call_ms"]] for name in ("ours", "openpi")]  # fmt: skip
    print_table(["server", "n", "rtt ms", "engine action ms", "server overhead ms",
                 "client path ms", "rtt - direct call ms"], rows)  # fmt: skip
    print(
        f"direct call (no socket): {o['direct']['rtt_ms']:.2f} ms, of it beyond the engine's "
        f"action (the layout's checks, cycle tail) {o['direct']['handle_beyond_engine_ms']:.3f} ms"
    )
    print()
    print_table(["design", "clients", "chunks/s", "actions/s", "ours / this"],
                [[t["design"], t["clients"], t["chunks_per_s"], t["actions_per_s"],
                  t["ours_over_this"]] for t in r["throughput"]])  # fmt: skip
    ours = o["ours"]["server_overhead_ms"]
    verdict = "MET" if r["overhead_goal_met"] else "MISSED"
    print(f"\nserver overhead beyond the engine's action latency and msgpack: {ours:.3f} ms "
          f"per request (goal <= {r['goal_overhead_ms']} ms): {verdict}")  # fmt: skip
    print("where we lose: " + ("; ".join(r["losses"]) or "nowhere"))
