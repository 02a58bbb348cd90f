"""`embodied-kv bench capsule`: time to first token, cold prefill vs capsule restore.

For each prefix length: a frame prefix (cameras + prompt) extended with text to
that length. Cold = prefill it into an empty slot + one decode step. Restore = copy
a capsule of the same boundary back into the arena (after the arena was scribbled
over) + the same decode step. Both in this process; snapshot / restore are also
timed per tier (gpu = the engine's device, host, disk). `token_exact`: the next
tokens after restore equal those after the cold prefill.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time

import torch

from embodied_kv.bench.report import device_name, print_table, set_cpu_threads, write_json
from embodied_kv.kv.capsule import capture, identity_of, restore
from embodied_kv.kv.capsule_store import CapsuleStore, StoreConfig
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

CHECK_TOKENS = 8  # tokens compared after restore


def timed(fn, sync, repeats: int) -> tuple[float, object]:
    """Median ms of `repeats` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), out


def fill_to(model, arena, slot, prefix, length: int) -> torch.Tensor:
    """Prefill the frame prefix, then append text until the slot holds `length` rows."""
    lg = model.prefill(arena, slot, prefix)
    extra = length - arena.slot_len(slot)
    if extra > 0:
        ids = torch.arange(extra) % 200 + 32  # printable bytes / low ids of any vocab
        lg = model.append(arena, slot, ids)
    return lg


def greedy(model, arena, slot, logits, n: int) -> list[int]:
    tok, out = logits.argmax().view(1), []
    for _ in range(n):
        out.append(int(tok))
        tok = model.decode(arena, [slot], tok)[0].argmax().view(1)
    return out


def bench_prefix(model):
    return model.embed_prefix(synthetic_observation(model.cfg, 0, "bench the capsule"))


def measure(model, length: int, repeats: int, sync, disk_dir: str) -> dict:
    prefix = bench_prefix(model)
    # a frame prefix (pi05: 3 cameras = 923+ rows) is the shortest boundary there is
    length = max(length, prefix.embeds.shape[0])
    max_len = 64 * math.ceil((length + CHECK_TOKENS + 64) / 64)
    arena = model.new_arena(2, max_len)
    ident = identity_of(model, arena)
    slot = arena.allocate()

    def cold():
        arena.clear(slot)
        lg = fill_to(model, arena, slot, prefix, length)
        return model.decode(arena, [slot], lg.argmax().view(1))[0]

    cold_ms, _ = timed(cold, sync, repeats)
    arena.clear(slot)
    lg = fill_to(model, arena, slot, prefix, length)
    cold_tokens = greedy(model, arena, slot, lg, CHECK_TOKENS)
    arena.clear(slot)
    lg = fill_to(model, arena, slot, prefix, length)

    store = CapsuleStore(
        StoreConfig(gpu_bytes=1 << 40, host_bytes=1 << 40, disk_dir=disk_dir), model.device
    )
    row = {"prefix_len": arena.slot_len(slot), "cold_ms": cold_ms}
    for tier in ("gpu", "host", "disk"):
        snap_ms, cap = timed(lambda: capture(f"p{length}", arena, None, ident), sync, repeats)
        t = time.perf_counter()
        store.put(cap, tier)
        sync()
        row[f"snapshot_{tier}_ms"] = snap_ms + 1e3 * (time.perf_counter() - t)

        def restore_from(tier=tier, cap=cap):
            c = store.get(f"p{length}") if tier == "gpu" else reload(store, cap, tier)
            restore(c, arena, None, ident)

        arena.k.normal_()
        row[f"restore_{tier}_ms"], _ = timed(restore_from, sync, repeats)
    row["bytes"] = cap.nbytes
    row["snapshot_ms"] = row["snapshot_gpu_ms"]  # the device tier: the one the goal names

    def restore_first_token():
        restore(store.get(f"p{length}"), arena, None, ident)
        return model.decode(arena, [slot], lg.argmax().view(1))[0]

    row["restore_ms"], _ = timed(restore_first_token, sync, repeats)
    restore(store.get(f"p{length}"), arena, None, ident)
    row["token_exact"] = greedy(model, arena, slot, lg, CHECK_TOKENS) == cold_tokens
    row["speedup"] = row["cold_ms"] / row["restore_ms"]
    return row


def reload(store: CapsuleStore, cap, tier: str):
    """Put the capsule back into `tier` so every timed restore starts from there."""
    store.put(cap, tier)
    return store.get(cap.name)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prefix_len"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot(x, [r["cold_ms"] for r in rows], "o-", label="cold prefill + 1st token")
    ax[0].plot(x, [r["restore_ms"] for r in rows], "o-", label="restore + 1st token")
    for tier in ("gpu", "host", "disk"):
        ax[1].plot(x, [r[f"restore_{tier}_ms"] for r in rows], "o-", label=f"restore {tier}")
    for a, t in zip(ax, ("time to first token (ms)", "restore by tier (ms)"), strict=True):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("prefix tokens")
        a.set_title(t)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embodied-kv bench capsule", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sweep, < 60 s on a 2-core CPU")
    p.add_argument("--json", help="write the results here (a PNG plot goes beside it)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--allow-cpu-pi05", action="store_true")
    a = p.parse_args(argv)
    if a.preset == "pi05" and a.device == "cpu" and not a.allow_cpu_pi05:
        print("pi05 on the CPU takes hours; use --device cuda or --allow-cpu-pi05", file=sys.stderr)
        return 2
    set_cpu_threads(a.threads)
    model = build_model(get_preset(a.preset), a.device)
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        lengths = (1024, 4096) if a.quick else (256, 512, 1024, 2048, 4096, 8192)
    else:
        lengths = (128, 512, 2048) if a.quick else (128, 256, 512, 1024, 2048)
    repeats = 3 if a.quick else 5
    shortest = bench_prefix(model).embeds.shape[0]
    lengths = sorted({max(n, shortest) for n in lengths})
    with tempfile.TemporaryDirectory(prefix="ekv-capsules-") as disk:
        rows = [measure(model, n, repeats, sync, disk) for n in lengths]
    result = {
        "benchmark": "capsule",
        "device": device_name(a.device),
        "preset": a.preset,
        "quick": a.quick,
        "speedup_longest": rows[-1]["speedup"],
        "token_exact": all(r["token_exact"] for r in rows),
        "rows": rows,
    }
    print_table(
        [
            "prefix",
            "cold ms",
            "restore ms",
            "speedup",
            "snap gpu",
            "rest gpu",
            "rest host",
            "rest disk",
            "MiB",
            "exact",
        ],
        [
            [
                r["prefix_len"],
                r["cold_ms"],
                r["restore_ms"],
                r["speedup"],
                r["snapshot_gpu_ms"],
                r["restore_gpu_ms"],
                r["restore_host_ms"],
                r["restore_disk_ms"],
                r["bytes"] / 2**20,
                r["token_exact"],
            ]
            for r in rows
        ],
    )
    print(
        f"capsule [{result['device']}, {a.preset}]: restore+first token is "
        f"{rows[-1]['speedup']:.1f}x faster than cold prefill at {rows[-1]['prefix_len']} "
        f"tokens; token_exact={result['token_exact']}"
    )
    if a.json:
        write_json(result, a.json)
        plot(rows, a.json.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
