"""`embodied-kv bench step`: the packed step vs the strongest Hugging Face baselines.

Every baseline runs in this process on the same device, dtype and weights; they are
listed and labelled in bench/baselines.py. Repeats are interleaved round-robin with
ours (harness.py) and every ratio is the median over rounds of baseline / ours, so a
figure above 1 means ours is faster and below 1 that the baseline is.

    prefill  P tokens of text into an empty slot, logits of the last token.
             ours: one packed step.  HF (eager, sdpa): one forward with a fresh
             DynamicCache and logits_to_keep=1 (what `generate` does first).
    decode   B requests with prompts of different lengths, greedy, per decode step of
             all B (ms). ours: the B prompts prefilled in one packed step, then ONE
             packed step per token for all B slots. HF: the interval between successive
             logits-processor calls inside `generate` (forward, cache update, sampling).
             `text` rows: the end-to-end time of the same B requests (prefill + decode).
    denoise  10 Euler steps of the action expert over a camera + prompt prefix.
             ours: ActionExpert.sample reads the prefix rows in place in the arena.

`exact` is true when, for every batch, our greedy tokens equal those of HF `generate`
one request at a time (eager) and the batched decode equals each request decoded alone
(token ids and logit bytes). `gemm_row_invariance` is the probe behind the padding:
the row counts whose GEMM results differ from a 32-row GEMM for this model's shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from embodied_kv.bench import harness
from embodied_kv.bench.baselines import expert_baselines, language_baselines
from embodied_kv.bench.report import print_table
from embodied_kv.kernels.packed_attention import KEY_BLOCK, ROW_BUCKET
from embodied_kv.model.checkpoint import load_pi05_checkpoint
from embodied_kv.model.config import get_preset
from embodied_kv.model.hf_interop import arena_to_dynamic_cache
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import VLA, StepInput, build_model
from embodied_kv.storage.arena import KVArena
from embodied_kv.timing import CPU_CLOCKS, device_clock, elapsed_ms


@dataclass(frozen=True)
class Sweep:
    prefill: tuple[int, ...]  # prefix lengths, tokens
    batches: tuple[int, ...]  # decode batch sizes
    context: int  # decode prompt length of request 0; request i gets context + 3 i
    new_tokens: int  # greedy tokens per request
    repeats: int  # interleaved rounds of every measurement (median over rounds)


PREFILL_INNER_TOKENS = 512  # prefills shorter than this repeat inside one timed sample

SWEEPS = {
    ("tiny", False): Sweep((64, 128, 256), (1, 4, 16), 96, 32, 9),
    ("tiny", True): Sweep((64, 256), (1, 4, 16), 64, 12, 7),
    ("tiny", "smoke"): Sweep((64,), (1, 4), 32, 6, 2),  # tests only
    ("pi05", False): Sweep((256, 512, 1024), (1, 4, 16), 512, 32, 10),
    # quick at pi05: two batch sizes, since the compiled HF baseline compiles ~100 s for each
    # on an H100 (bench/results/2026-11-22-nvidia-h100-80gb-hbm3/RUNS.md)
    ("pi05", True): Sweep((256, 512, 1024), (1, 16), 512, 16, 3),
}


def arena_for(model: VLA, slots: int, rows: int) -> KVArena:
    return model.new_arena(slots, -(-rows // KEY_BLOCK) * KEY_BLOCK)


def random_ids(n: int, vocab: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def stats(samples) -> dict:
    return harness.Stats.of(samples).as_dict()


def row(kind: str, baseline: str, label: str, ours: list, theirs: list | None, **fields):
    """One comparison; `theirs` None when the baseline could not run (fields say why)."""
    out = {"kind": kind, **fields, "baseline": baseline, "label": label, "ours": stats(ours)}
    out["ours_ms"] = out["ours"]["median"]
    if theirs is None:
        return {**out, "baseline_ms": None, "speedup": None}
    out["theirs"] = stats(theirs)
    out["baseline_ms"] = out["theirs"]["median"]
    out["speedup"] = harness.ratio(theirs, ours)
    return out


# -- prefill ------------------------------------------------------------------------------


def prefill_rows(model, hfs: dict, n: int, repeats: int, cpu: str) -> list[dict]:
    ids = random_ids(n, model.cfg.vocab_size, n, model.device)
    arena = arena_for(model, 1, n)
    slot = arena.allocate()
    out = {}

    def ours():
        arena.clear(slot)
        out["ours"] = model.append(arena, slot, ids)

    def forward(name):
        hf = hfs[name].model
        cache = DynamicCache(config=hf.config)
        r = hf(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        out[name] = r.logits[0, -1].float()

    names = ("hf_eager_one_by_one", "hf_sdpa_batched")
    fns = {"ours": ours, **{name: (lambda name=name: forward(name)) for name in names}}
    inner = max(1, PREFILL_INNER_TOKENS // n)  # short prefills: several per timed sample
    fns = {k: harness.looped(fn, inner) for k, fn in fns.items()}
    t = harness.interleave(fns, model.device, warmup=1, repeats=repeats, cpu=cpu)
    t = {k: [ms / inner for ms in v] for k, v in t.items()}
    rows = []
    for name in names:
        diff = (out["ours"] - out[name]).abs().max().item()
        attn = hfs[name].model.config._attn_implementation
        label = f"HF forward ({attn}) into a fresh DynamicCache, logits_to_keep=1"
        rows.append(row("prefill", f"hf_{attn}", label, t["ours"], t[name], tokens=n))
        rows[-1]["max_abs_logit_diff"] = diff
    return rows


# -- decode -------------------------------------------------------------------------------


def ours_generate(
    model, prompts: list[torch.Tensor], new_tokens: int, batched: bool, cpu: str = "wall"
):
    """Prefill (one packed step), then greedy decode, all slots in one step per token
    (batched) or each slot alone -> (tokens, logits [B, T-1, V], step ms, total ms), timed
    on the CPU clock `cpu` (timing.CPU_CLOCKS) on a CPU."""
    clock = device_clock(model.device, cpu)
    arena = arena_for(model, len(prompts), max(p.shape[0] for p in prompts) + new_tokens)
    slots = [arena.allocate() for _ in prompts]
    groups = [slots] if batched else [[s] for s in slots]
    t0 = clock()
    first = model.step(arena, [StepInput(s, ids=p) for s, p in zip(slots, prompts, strict=True)])
    cur = first.argmax(-1)
    tokens, logits, step_ms = [[t] for t in cur.tolist()], [[] for _ in slots], []
    for group in groups:
        idx = [slots.index(s) for s in group]
        ids = cur[idx]
        for _ in range(new_tokens - 1):
            t = clock()
            lg = model.decode(arena, group, ids)
            ids = lg.argmax(-1)
            step_ms.append(elapsed_ms(t, clock))
            for j, (i, tok) in enumerate(zip(idx, ids.tolist(), strict=True)):
                tokens[i].append(tok)
                logits[i].append(lg[j])
    total = elapsed_ms(t0, clock)
    return tokens, torch.stack([torch.stack(x) for x in logits]), step_ms, total


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def decode_rows(model, hfs: dict, batch: int, sweep: Sweep, cpu: str) -> tuple[list[dict], bool]:
    """Rows for batch size B (decode and text per baseline) and whether B is exact."""
    vocab, T = model.cfg.vocab_size, sweep.new_tokens
    prompts = [
        random_ids(sweep.context + 3 * i, vocab, 1000 + i, model.device) for i in range(batch)
    ]
    alone_tok, alone_lg, _, _ = ours_generate(model, prompts, T, batched=False)
    ours_tok, ours_lg, _, _ = ours_generate(model, prompts, T, batched=True)
    batched_exact = ours_tok == alone_tok and torch.equal(ours_lg, alone_lg)

    def ours():
        tok, _, steps, total = ours_generate(model, prompts, T, batched=True, cpu=cpu)
        return tok, statistics.median(steps), total

    for b in hfs.values():  # per batch: a compiled baseline may recompile for a new shape
        b.warm(prompts, T)
    live = {name: b for name, b in hfs.items() if b.unavailable is None}
    fns = {"ours": ours, **{name: (lambda b=b: b(prompts, T)) for name, b in live.items()}}
    res = harness.interleave_calls(fns, warmup=0, repeats=sweep.repeats)
    ours_step = [r[1] for r in res["ours"]]
    ours_total = [r[2] for r in res["ours"]]
    rows, equal_hf = [], None
    for name, b in hfs.items():
        extra = {"batch": batch, "context": sweep.context, "new_tokens": T}
        if b.compile_s is not None:
            extra["compile_s"] = b.compile_s
        if name not in live:
            rows.append(row("decode", name, b.label, ours_step, None, **extra))
            rows[-1]["unavailable"] = b.unavailable
            continue
        gen = res[name]
        agree = agreement(ours_tok, gen[-1].tokens)
        if name == "hf_eager_one_by_one":
            equal_hf = ours_tok == gen[-1].tokens
        d = row("decode", name, b.label, ours_step, [g.step_ms for g in gen], **extra)
        d["token_agreement"] = agree
        rows.append(d)
        rows.append(row("text", name, b.label, ours_total, [g.total_ms for g in gen], **extra))
    for r in rows:
        r["batched_equals_one_by_one"] = batched_exact
    return rows, bool(batched_exact and equal_hf)


# -- denoise ------------------------------------------------------------------------------


def denoise_rows(model, repeats: int, compiled: bool, cpu: str) -> list[dict]:
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 0))
    n = prefix.embeds.shape[0]
    arena = arena_for(model, 1, n)
    slot = arena.allocate()
    model.prefill(arena, slot, prefix)
    noise = model.make_noise(0)
    cache = arena_to_dynamic_cache(arena, slot, n)  # what the HF prefix prefill returns
    baselines = expert_baselines(model.expert, cache, n, noise, compiled)
    out = {}

    def ours():
        out["ours"] = model.sample_actions(arena, slot, n, noise)

    def theirs(b):
        out[b.name] = b.fn()

    live = [b for b in baselines if b.unavailable is None]
    fns = {"ours": ours, **{b.name: (lambda b=b: theirs(b)) for b in live}}
    t = harness.interleave(fns, model.device, warmup=1, repeats=repeats, cpu=cpu)
    rows = []
    for b in baselines:
        extra = {"tokens": n, "steps": model.cfg.denoise_steps}
        if b.compile_s is not None:
            extra["compile_s"] = b.compile_s
        r = row("denoise", b.name, b.label, t["ours"], t.get(b.name), **extra)
        if b.unavailable is None:
            r["max_abs_action_diff"] = (
                (out["ours"].float() - out[b.name].float()).abs().max().item()
            )
        else:
            r["unavailable"] = b.unavailable
        rows.append(r)
    return rows


# -- the padding probe --------------------------------------------------------------------


def gemm_row_invariance(model, max_rows: int = 16, ref_rows: int = 32) -> dict:
    """For every distinct linear shape of the model: the row counts M <= max_rows whose
    rows differ in any bit from the same rows of a ref_rows GEMM (fp32 on CPU: small M
    takes other kernels). The packed step pads to multiples of ROW_BUCKET; none of those
    may appear here."""
    shapes = sorted(
        {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    )
    g = torch.Generator().manual_seed(0)
    bad = set()
    for n_out, n_in in shapes:
        w = torch.randn(n_out, n_in, generator=g).to(model.device, model.dtype)
        x = torch.randn(ref_rows, n_in, generator=g).to(model.device, model.dtype)
        ref = F.linear(x, w)
        bad |= {m for m in range(1, max_rows + 1) if not torch.equal(F.linear(x[:m], w), ref[:m])}
    padded = [m for m in sorted(bad) if m % ROW_BUCKET == 0]
    return {
        "shapes": [list(s) for s in shapes],
        "differ": sorted(bad),
        "row_bucket": ROW_BUCKET,
        "bucket_sizes_that_differ": padded,
    }


# -- entry point --------------------------------------------------------------------------


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv bench step", description=__doc__.split("\n")[0])
    harness.add_common_args(p)
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: tiny sweep
    p.add_argument(
        "--skip-compiled", action="store_true", help="report the torch.compile baselines as skipped"
    )
    p.add_argument(
        "--clock",
        choices=sorted(CPU_CLOCKS),
        default="wall",
        help="CPU timings on wall time or this thread's CPU time (excludes other processes' "
        "slices on a shared CPU; valid at one thread)",
    )
    p.add_argument("--checkpoint", help="pi0.5 safetensors (LeRobot layout); else random")
    p.add_argument("--tokenizer", help="Gemma tokenizer path (pi05); else bytes")
    args = harness.parse(p, argv)
    if args.clock == "thread" and (args.device != "cpu" or args.threads != 1):
        p.error("--clock thread times one CPU thread's work: needs --device cpu and --threads 1")
    return args


def build(args) -> VLA:
    overrides = {} if args.tokenizer or args.preset == "tiny" else {"tokenizer": "bytes"}
    cfg = get_preset(args.preset, **overrides)
    model = build_model(cfg, args.device, tokenizer_path=args.tokenizer)
    if args.checkpoint:
        load_pi05_checkpoint(model, args.checkpoint)
    return model


def report(rows: list[dict]) -> None:
    table = []
    for r in rows:
        size = f"B={r['batch']}" if "batch" in r else r["tokens"]
        speed = "n/a: " + r["unavailable"][:40] if r["speedup"] is None else f"{r['speedup']:.2f}x"
        base = "-" if r["baseline_ms"] is None else r["baseline_ms"]
        table.append([r["kind"], size, r["baseline"], r["ours_ms"], base, speed])
    print_table(["row", "size", "baseline", "ours ms", "base ms", "base/ours"], table)


def main(argv=None) -> int:
    args = parse(argv)
    env = harness.Environment.start(args, argv)
    sweep = SWEEPS[(args.preset, "smoke" if args.smoke else args.quick)]
    with torch.no_grad():
        model = build(args)
        harness.progress(env, "model built")
        baselines = language_baselines(model, not args.skip_compiled, args.clock)
        hfs = {b.name: b for b in baselines}
        warm = [random_ids(sweep.context, model.cfg.vocab_size, 0, model.device)]
        ours_generate(model, warm, 3, batched=True)
        harness.progress(env, "baselines built")
        rows = []
        for n in sweep.prefill:
            rows += prefill_rows(model, hfs, n, sweep.repeats, args.clock)
            harness.progress(env, f"prefill {n} measured")
        exact = True
        for b in sweep.batches:
            more, ok = decode_rows(model, hfs, b, sweep, args.clock)
            rows += more
            exact &= ok
            harness.progress(env, f"decode B={b} measured")
        rows += denoise_rows(model, 2 * sweep.repeats, not args.skip_compiled, args.clock)
        harness.progress(env, "denoise measured")
        invariance = gemm_row_invariance(model)
    ratios = {
        f"{r['kind']}/{r.get('batch', r.get('tokens'))}/{r['baseline']}": r["speedup"] for r in rows
    }
    b1 = ratios.get("decode/1/hf_sdpa_batched")
    result = {
        "benchmark": "step",
        "preset": args.preset,
        "dtype": str(model.dtype).removeprefix("torch."),
        "quick": args.quick,
        "clock": args.clock,
        "checkpoint": args.checkpoint,
        "sweep": asdict(sweep),
        "rows": rows,
        "ratios": ratios,
        "decode_b1_vs_hf_sdpa_one_request": b1,
        "gemm_row_invariance": invariance,
        "exact": exact,
    }
    result = harness.finish(result, env, args.json)
    print(
        f"bench step: preset {args.preset} on {result['device']} ({result['dtype']}), "
        f"{args.clock} clock"
    )
    report(rows)
    if b1 is not None:
        print(f"decode B=1 vs HF sdpa one-request generate: {b1:.2f}x (above 1: ours faster)")
    print(f"exact: {exact}; GEMM rows that differ from 32 rows: {invariance['differ']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
