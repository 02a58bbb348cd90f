"""`embodied-kv bench step`: the packed step vs Hugging Face transformers, same weights.

Both sides run in this process on the same device and dtype (fp32 on CPU, bf16 on
CUDA); the baseline is `to_hf_gemma(model, share=True)`, a GemmaForCausalLM (eager
attention) whose parameters are the backbone's own tensors.

    prefill  P tokens of text into an empty slot, logits of the last token.
             ours: one packed step.  HF: one forward with a fresh DynamicCache and
             logits_to_keep=1 (what `generate` does first, without its setup cost).
    decode   B requests with prompts of different lengths, greedy.
             ours: the B prompts prefilled in one packed step, then ONE packed step
             per token for all B slots.  HF: `generate(do_sample=False)` one request
             at a time, the way users run it; a step's time is the interval between
             successive logits-processor calls inside `generate` (forward, cache
             update, sampling), so B requests advance one token in B such steps.
             `text` rows give the end-to-end time of the same B requests.
    denoise  10 Euler steps of the action expert over a camera + prompt prefix.
             ours: ActionExpert.sample reads the prefix rows in place in the arena.
             HF: LeRobot pi05's loop (hf_interop.sample_actions_hf_style): every step
             clones the prefix DynamicCache, appends the suffix K/V to it with
             cache.update (torch.cat) and runs transformers' eager attention with a
             4D mask. Same expert modules and weights; the difference is the cache.

`exact` is true when, for every decode row, our greedy tokens equal `generate`'s and
the batched decode equals each request decoded alone (token ids and logit bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import transformers
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from embodied_kv.bench.report import device_name, print_table, write_json
from embodied_kv.kernels.packed_attention import KEY_BLOCK
from embodied_kv.kv.arena import KVArena
from embodied_kv.model.checkpoint import load_pi05_checkpoint
from embodied_kv.model.config import get_preset
from embodied_kv.model.hf_interop import (
    arena_to_dynamic_cache,
    sample_actions_hf_style,
    to_hf_gemma,
)
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import VLA, StepInput, build_model


@dataclass(frozen=True)
class Sweep:
    prefill: tuple[int, ...]  # prefix lengths, tokens
    batches: tuple[int, ...]  # decode batch sizes
    context: int  # decode prompt length of request 0; request i gets context + 3 i
    new_tokens: int  # greedy tokens per request
    repeats: int  # timed repetitions of prefill and denoise (median)


SWEEPS = {
    ("tiny", False): Sweep((64, 128, 256), (1, 4, 16), 96, 32, 7),
    ("tiny", True): Sweep((64, 128, 256), (1, 4, 16), 64, 12, 3),
    ("tiny", "smoke"): Sweep((64,), (1, 4), 32, 6, 1),  # tests only
    ("pi05", False): Sweep((256, 512, 1024), (1, 4, 16), 512, 32, 10),
    ("pi05", True): Sweep((256, 512, 1024), (1, 4, 16), 512, 16, 3),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, lazy init
    times = []
    for _ in range(repeats):
        t0 = clock(device)
        fn()
        times.append((clock(device) - t0) * 1e3)
    return statistics.median(times)


def arena_for(model: VLA, slots: int, rows: int) -> KVArena:
    return model.new_arena(slots, -(-rows // KEY_BLOCK) * KEY_BLOCK)


def random_ids(n: int, vocab: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def row(kind: str, ours_ms: float, hf_ms: float, **fields) -> dict:
    return {"kind": kind, **fields, "ours_ms": ours_ms, "hf_ms": hf_ms, "speedup": hf_ms / ours_ms}


# -- rows ---------------------------------------------------------------------------------


def prefill_row(model, hf, n: int, repeats: int) -> dict:
    dev = model.device
    ids = random_ids(n, model.cfg.vocab_size, n, dev)
    arena = arena_for(model, 1, n)
    slot = arena.allocate()
    out = {}

    def ours():
        arena.clear(slot)
        out["ours"] = model.append(arena, slot, ids)

    def theirs():
        cache = DynamicCache(config=hf.config)
        out["hf"] = hf(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)

    ours_ms, hf_ms = median_ms(ours, dev, repeats), median_ms(theirs, dev, repeats)
    diff = (out["ours"] - out["hf"].logits[0, -1].float()).abs().max().item()
    return row("prefill", ours_ms, hf_ms, tokens=n, max_abs_logit_diff=diff)


class StepClock(LogitsProcessor):
    """Called once per generated token inside `generate`; records when."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        self.times.append(clock(self.device))
        return scores


def hf_generate(hf, prompts: list[torch.Tensor], new_tokens: int):
    """One request at a time -> (tokens per request, decode-step ms per request, total ms)."""
    dev = prompts[0].device
    tokens, step_ms = [], []
    t0 = clock(dev)
    for ids in prompts:
        stamps = StepClock(dev)
        out = hf.generate(
            ids[None],
            attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long, device=dev),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
        )
        tokens.append(out[0, ids.shape[0] :].tolist())
        gaps = [(b - a) * 1e3 for a, b in zip(stamps.times, stamps.times[1:], strict=False)]
        step_ms.append(statistics.median(gaps))
    return tokens, step_ms, (clock(dev) - t0) * 1e3


def ours_generate(model, prompts: list[torch.Tensor], new_tokens: int, batched: bool):
    """Prefill (one packed step), then greedy decode, all slots in one step per token
    (batched) or each slot alone -> (tokens, logits [B, T-1, V], step ms, total ms)."""
    dev = model.device
    arena = arena_for(model, len(prompts), max(p.shape[0] for p in prompts) + new_tokens)
    slots = [arena.allocate() for _ in prompts]
    groups = [slots] if batched else [[s] for s in slots]
    t0 = clock(dev)
    first = model.step(arena, [StepInput(s, ids=p) for s, p in zip(slots, prompts, strict=True)])
    cur = first.argmax(-1)
    tokens, logits, step_ms = [[t] for t in cur.tolist()], [[] for _ in slots], []
    for group in groups:
        idx = [slots.index(s) for s in group]
        ids = cur[idx]
        for _ in range(new_tokens - 1):
            t = clock(dev)
            lg = model.decode(arena, group, ids)
            ids = lg.argmax(-1)
            step_ms.append((clock(dev) - t) * 1e3)
            for j, (i, tok) in enumerate(zip(idx, ids.tolist(), strict=True)):
                tokens[i].append(tok)
                logits[i].append(lg[j])
    total = (clock(dev) - t0) * 1e3
    return tokens, torch.stack([torch.stack(x) for x in logits]), step_ms, total


def decode_rows(model, hf, batch: int, sweep: Sweep) -> list[dict]:
    dev, vocab = model.device, model.cfg.vocab_size
    prompts = [random_ids(sweep.context + 3 * i, vocab, 1000 + i, dev) for i in range(batch)]
    T = sweep.new_tokens
    # One by one first: it also warms up the packed prefill of these prompts.
    alone_tok, alone_lg, alone_steps, _ = ours_generate(model, prompts, T, batched=False)
    ours_tok, ours_lg, ours_steps, ours_total = ours_generate(model, prompts, T, batched=True)
    hf_tok, hf_steps, hf_total = hf_generate(hf, prompts, T)
    agree = sum(
        a == b for x, y in zip(ours_tok, hf_tok, strict=True) for a, b in zip(x, y, strict=True)
    )
    decode = row(
        "decode",
        statistics.median(ours_steps),
        sum(hf_steps),  # B requests, one token each, one after another
        batch=batch,
        context=sweep.context,
        ours_one_by_one_ms=batch * statistics.median(alone_steps),
        tokens_equal_hf=ours_tok == hf_tok,
        hf_token_agreement=agree / (batch * T),
        batched_equals_one_by_one=ours_tok == alone_tok and torch.equal(ours_lg, alone_lg),
    )
    text = row("text", ours_total, hf_total, batch=batch, context=sweep.context, new_tokens=T)
    return [decode, text]


def denoise_row(model, repeats: int) -> dict:
    dev = model.device
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 0))
    n = prefix.embeds.shape[0]
    arena = arena_for(model, 1, n)
    slot = arena.allocate()
    model.prefill(arena, slot, prefix)
    noise = model.make_noise(0)
    cache = arena_to_dynamic_cache(arena, slot, n)  # what the HF prefix prefill returns
    out = {}

    def ours():
        out["ours"] = model.sample_actions(arena, slot, n, noise)

    def theirs():
        out["hf"] = sample_actions_hf_style(model.expert, cache, n, noise)

    ours_ms, hf_ms = median_ms(ours, dev, repeats), median_ms(theirs, dev, repeats)
    diff = (out["ours"].float() - out["hf"].float()).abs().max().item()
    steps = model.cfg.denoise_steps
    return row("denoise", ours_ms, hf_ms, tokens=n, steps=steps, max_abs_action_diff=diff)


# -- entry point --------------------------------------------------------------------------


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv bench step", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["tiny", "pi05"], default="tiny")
    p.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: tiny sweep
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--checkpoint", help="pi0.5 safetensors (LeRobot layout); else random")
    p.add_argument("--tokenizer", help="Gemma tokenizer path (pi05); else bytes")
    p.add_argument("--allow-cpu-pi05", action="store_true", help="run pi05 on a CPU anyway")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.device == "cpu" and args.preset == "pi05" and not args.allow_cpu_pi05:
        p.error(
            "pi05 on a CPU needs ~13 GB in fp32 and minutes per step; use --device cuda, "
            "--preset tiny, or pass --allow-cpu-pi05"
        )
    return args


def build(args) -> VLA:
    overrides = {} if args.tokenizer or args.preset == "tiny" else {"tokenizer": "bytes"}
    cfg = get_preset(args.preset, **overrides)
    model = build_model(cfg, args.device, tokenizer_path=args.tokenizer)
    if args.checkpoint:
        load_pi05_checkpoint(model, args.checkpoint)
    return model


def check(r: dict) -> str:
    if r["kind"] == "decode":
        exact = r["tokens_equal_hf"] and r["batched_equals_one_by_one"]
        return f"exact={exact}, ours one by one {r['ours_one_by_one_ms']:.3g} ms"
    diff = r.get("max_abs_logit_diff", r.get("max_abs_action_diff"))
    return "" if diff is None else f"max|diff| {diff:.2g}"


def report(rows: list[dict]) -> None:
    table = []
    for r in rows:
        size = f"B={r['batch']}" if "batch" in r else r["tokens"]
        table.append([r["kind"], size, r["ours_ms"], r["hf_ms"], f"{r['speedup']:.2f}x", check(r)])
    print_table(["row", "size", "ours ms", "HF ms", "HF/ours", "check"], table)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    sweep = SWEEPS[(args.preset, "smoke" if args.smoke else args.quick)]
    with torch.no_grad():
        model = build(args)
        hf = to_hf_gemma(model, share=True)
        warm = [random_ids(sweep.context, model.cfg.vocab_size, 0, model.device)]
        ours_generate(model, warm, 3, batched=True)
        hf_generate(hf, warm, 3)
        rows = [prefill_row(model, hf, n, sweep.repeats) for n in sweep.prefill]
        for b in sweep.batches:
            rows += decode_rows(model, hf, b, sweep)
        rows.append(denoise_row(model, sweep.repeats))
    decode = [r for r in rows if r["kind"] == "decode"]
    result = {
        "benchmark": "step",
        "device": device_name(args.device),
        "preset": args.preset,
        "dtype": str(model.dtype).removeprefix("torch."),
        "transformers": transformers.__version__,
        "quick": args.quick,
        "checkpoint": args.checkpoint,
        "sweep": asdict(sweep),
        "rows": rows,
        "speedup_decode_vs_hf": decode[-1]["speedup"],  # at the largest batch
        "speedup_decode_vs_hf_by_batch": {str(r["batch"]): r["speedup"] for r in decode},
        "exact": all(r["tokens_equal_hf"] and r["batched_equals_one_by_one"] for r in decode),
    }
    print(f"bench step: preset {args.preset} on {result['device']} ({result['dtype']})")
    report(rows)
    speedup, largest = result["speedup_decode_vs_hf"], decode[-1]["batch"]
    print(f"decode speedup vs HF at B={largest}: {speedup:.2f}x; exact: {result['exact']}")
    if args.json:
        write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
