"""`embodied-kv bench capsule`: time to first token, cold prefill vs capsule restore vs
a prefix kept resident.

For each prefix length: a frame prefix (cameras + prompt) extended with text to that
length. Every path ends with the same first decoded token:

    cold (ours)     prefill it into an empty slot (the package's packed step) + 1 token
    cold (HF sdpa)  GemmaForCausalLM with sdpa over the same embeddings, fresh
                    DynamicCache, + 1 token (the strongest cold baseline: causal mask,
                    the same FLOPs as the bidirectional pi0.5 prefix)
    resident        the prefix still sits in a slot (prefix caching): fork it into a free
                    slot (a byte copy of its rows, the arena's copy-on-write) + 1 token
    restore         copy a capsule of the same boundary back into the arena (after the
                    arena was scribbled over) + 1 token

Cold, resident and restore repeats are interleaved (harness.py); speedups are medians
of per-round ratios. Snapshot and restore are also timed per tier (gpu = the engine's
device, host, disk): a host or disk restore is `store.get` (read, verify, move) +
restore, and putting the capsule back into its tier between repeats is not timed.
`token_exact`: the next tokens after restore and after a fork equal those after the
cold prefill.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

import torch
from transformers import DynamicCache

from embodied_kv.bench import harness, host_work
from embodied_kv.bench.report import print_table
from embodied_kv.kv.capsule import capture, identity_of, restore
from embodied_kv.kv.capsule_store import CapsuleStore, StoreConfig
from embodied_kv.model.config import get_preset
from embodied_kv.model.hf_interop import to_hf_gemma
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.timing import device_clock, elapsed_ms

CHECK_TOKENS = 8  # tokens compared after restore
INNER = 20  # restore / fork calls per timed sample (they take ~1 ms; see harness.looped)


def text_ids(n: int) -> torch.Tensor:
    return torch.arange(n) % 200 + 32  # printable bytes / low ids of any vocab


def fill_to(model, arena, slot, prefix, length: int) -> torch.Tensor:
    """Prefill the frame prefix, then append text until the slot holds `length` rows."""
    lg = model.prefill(arena, slot, prefix)
    extra = length - arena.slot_len(slot)
    if extra > 0:
        lg = model.append(arena, slot, text_ids(extra).to(model.device))
    return lg


def greedy(model, arena, slot, logits, n: int) -> list[int]:
    tok, out = logits.argmax().view(1), []
    for _ in range(n):
        out.append(int(tok))
        tok = model.decode(arena, [slot], tok)[0].argmax().view(1)
    return out


def timed_with_setup(setup, fn, device, repeats: int) -> list[float]:
    """ms of fn, `repeats` times, each after an untimed setup() (one warm-up pair first)."""
    setup()
    fn()
    out = []
    for _ in range(repeats):
        setup()
        out.append(harness.time_once(fn, device))
    return out


def hf_cold(model, hf, prefix, length: int):
    """HF sdpa: the same embeddings (prefix + text) in one forward, then one token."""
    extra = max(0, length - prefix.embeds.shape[0])
    embeds = prefix.embeds
    if extra:
        embeds = torch.cat([embeds, model.backbone.embed(text_ids(extra).to(model.device))])

    def run():
        cache = DynamicCache(config=hf.config)
        out = hf(
            inputs_embeds=embeds[None], past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        tok = out.logits[0, -1].argmax().view(1, 1)
        return hf(input_ids=tok, past_key_values=cache, use_cache=True).logits[0, -1]

    return run


def bench_prefix(model):
    return model.embed_prefix(synthetic_observation(model.cfg, 0, "bench the capsule"))


def measure(model, hf, length: int, repeats: int, disk_dir: str) -> dict:
    dev = model.device
    prefix = bench_prefix(model)
    # a frame prefix (pi05: 3 cameras = 923+ rows) is the shortest boundary there is
    length = max(length, prefix.embeds.shape[0])
    max_len = 64 * math.ceil((length + CHECK_TOKENS + 64) / 64)
    arena = model.new_arena(2, max_len)  # cold and restore (restore owns the whole arena)
    resident = model.new_arena(2, max_len)  # the prefix kept in slot r, forked into slot f
    ident = identity_of(model, arena)
    slot = arena.allocate()
    r, f = resident.allocate(), resident.allocate()

    lg = fill_to(model, arena, slot, prefix, length)
    cold_tokens = greedy(model, arena, slot, lg, CHECK_TOKENS)
    arena.clear(slot)
    lg = fill_to(model, arena, slot, prefix, length)
    fill_to(model, resident, r, prefix, length)
    name = f"p{length}"
    store = CapsuleStore(StoreConfig(gpu_bytes=1 << 40, host_bytes=1 << 40, disk_dir=disk_dir), dev)
    store.put(capture(name, arena, None, ident), "gpu")
    first = lg.argmax().view(1)

    def cold():
        arena.clear(slot)
        out = fill_to(model, arena, slot, prefix, length)
        return model.decode(arena, [slot], out.argmax().view(1))[0]

    def restored():
        restore(store.get(name), arena, None, ident)
        return model.decode(arena, [slot], first)[0]

    def forked():
        resident.copy_slot(r, f)
        return model.decode(resident, [f], first)[0]

    fns = {
        "cold": cold,
        "cold_hf_sdpa": hf_cold(model, hf, prefix, length),
        "restore": harness.looped(restored, INNER),
        "resident": harness.looped(forked, INNER),
    }
    t = harness.interleave(fns, dev, warmup=1, repeats=repeats)
    for k in ("restore", "resident"):
        t[k] = [ms / INNER for ms in t[k]]
    row = {"prefix_len": length}
    for k, v in t.items():
        row[f"{k}_ms"] = harness.Stats.of(v).median
        row[f"{k}_stats"] = harness.Stats.of(v).as_dict()
    row["speedup"] = harness.ratio(t["cold"], t["restore"])  # ours cold / restore
    seed = [*host_work.model_seed(model, arena), resident.k, resident.v]
    host = host_work.arena_host(arena) + host_work.arena_host(resident)
    row["host_work"] = {k: host_work.count(fn, seed, host)  # one call: restore + a decode step
                        for k, fn in (("cold", cold), ("restore", restored),
                                      ("resident", forked))}  # fmt: skip
    row["speedup_vs_hf_sdpa"] = harness.ratio(t["cold_hf_sdpa"], t["restore"])
    row["resident_vs_restore"] = harness.ratio(t["resident"], t["restore"])  # < 1: resident wins

    restore(store.get(name), arena, None, ident)  # back to the boundary (no decoded token)
    for tier in ("gpu", "host", "disk"):
        clock = device_clock(dev)
        t0 = clock()
        cap = capture(name, arena, None, ident)
        store.put(cap, tier)
        row[f"snapshot_{tier}_ms"] = elapsed_ms(t0, clock)
        arena.k.normal_()  # scribbled over: every restore below must bring the bytes back
        row[f"restore_{tier}_ms"] = harness.Stats.of(
            timed_with_setup(
                lambda cap=cap, tier=tier: store.put(cap, tier) if tier != "gpu" else None,
                lambda: restore(store.get(name), arena, None, ident),
                dev,
                3 * repeats,
            )
        ).median
    row["bytes"] = cap.nbytes
    row["snapshot_ms"] = row["snapshot_gpu_ms"]  # the device tier: the one the goal names
    restore(store.get(name), arena, None, ident)
    row["token_exact"] = greedy(model, arena, slot, lg, CHECK_TOKENS) == cold_tokens
    resident.copy_slot(r, f)
    row["resident_token_exact"] = greedy(model, resident, f, lg, CHECK_TOKENS) == cold_tokens
    return row


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prefix_len"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].plot(x, [r["cold_ms"] for r in rows], "o-", label="cold prefill + 1st token")
    ax[0].plot(x, [r["cold_hf_sdpa_ms"] for r in rows], "o-", label="HF sdpa prefill + 1st token")
    ax[0].plot(x, [r["resident_ms"] for r in rows], "o-", label="resident prefix: fork + 1st")
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
    harness.add_common_args(p)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: 2 sizes
    a = harness.parse(p, argv)
    env = harness.Environment.start(a, argv)
    model = build_model(get_preset(a.preset), a.device)
    hf = to_hf_gemma(model, share=True, attn_implementation="sdpa")
    if a.device == "cuda":
        lengths = (1024, 4096) if a.quick else (256, 512, 1024, 2048, 4096, 8192)
    else:
        lengths = (128, 512, 2048) if a.quick else (128, 256, 512, 1024, 2048)
    repeats = 9 if a.quick else 15
    if a.smoke:
        lengths, repeats = (128, 512), 2
    shortest = bench_prefix(model).embeds.shape[0]
    lengths = sorted({max(n, shortest) for n in lengths})
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="ekv-capsules-") as disk:
        rows = [measure(model, hf, n, repeats, disk) for n in lengths]
    result = {
        "benchmark": "capsule",
        "preset": a.preset,
        "quick": a.quick,
        "speedup_longest": rows[-1]["speedup"],
        "speedup_vs_hf_sdpa_longest": rows[-1]["speedup_vs_hf_sdpa"],
        "ratios": {
            f"{r['prefix_len']}/{k}": r[k]
            for r in rows
            for k in ("speedup", "speedup_vs_hf_sdpa", "resident_vs_restore")
        },
        "token_exact": all(r["token_exact"] and r["resident_token_exact"] for r in rows),
        "rows": rows,
    }
    result = harness.finish(result, env, a.json)
    print_table(
        [
            "prefix",
            "cold ms",
            "HF sdpa ms",
            "resident ms",
            "restore ms",
            "cold/rest",
            "HF/rest",
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
                r["cold_hf_sdpa_ms"],
                r["resident_ms"],
                r["restore_ms"],
                r["speedup"],
                r["speedup_vs_hf_sdpa"],
                r["snapshot_gpu_ms"],
                r["restore_gpu_ms"],
                r["restore_host_ms"],
                r["restore_disk_ms"],
                r["bytes"] / 2**20,
                r["token_exact"] and r["resident_token_exact"],
            ]
            for r in rows
        ],
    )
    print(
        f"capsule [{result['device']}, {a.preset}]: restore+first token is "
        f"{rows[-1]['speedup']:.1f}x faster than our cold prefill and "
        f"{rows[-1]['speedup_vs_hf_sdpa']:.1f}x faster than HF sdpa's at "
        f"{rows[-1]['prefix_len']} tokens; token_exact={result['token_exact']}"
    )
    if a.json:
        plot(rows, a.json.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
