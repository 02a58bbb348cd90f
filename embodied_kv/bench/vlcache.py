"""`embodied-kv bench vlcache`: VL-Cache against the full cache and the baselines, at equal
KV budgets, in one run.

Methods (kv/presses.py): full, streaming (StreamingLLM), h2o, snapkv, pyramidkv, vlcache and
its two ablations (vlcache_uniform: post-vision scores, uniform budgets; vlcache_accum:
sparsity budgets, accumulated scores). Budget α = the fraction of the prefix's image KV rows
kept over all layers (the prompt text is always kept, by every method), at
{1, 5, 10, 20, 40}% and 100% (the full cache). Sections:

    speed     decode step and attention over compressed vs full slots, KV bytes, and the
              prefill overhead of the statistics (bench/vlcache_speed.py). `--preset tiny`:
              the world at 3 cameras and a larger image (random weights); `--preset pi05`:
              pi0.5's widths at `--layers` depth (random weights, a GPU, or a CPU with
              --allow-cpu-pi05)
    fidelity  top-1 and greedy-32 agreement with the full cache, CacheHitRate, on world
              scenes (bench/vlcache_fidelity.py): the trained model with --weights, else the
              long random world
    qa        with --weights: scene-question accuracy through the Engine per method and
              budget (eval/world.py question_results: the same questions for every row),
              then the acceptance verdict: vlcache at 10% within 3 points of full (with the
              paired standard error), and >= every other method at 5% and 10%
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from embodied_kv.bench import harness, vlcache_fidelity, vlcache_speed
from embodied_kv.bench.report import print_table
from embodied_kv.engine.engine import Engine
from embodied_kv.eval.world import EvalConfig, accuracy_of, make_engine, question_results
from embodied_kv.kv.compress import CompressConfig
from embodied_kv.kv.presses import PRESSES
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.trained import TOKENIZER_FILE, WEIGHTS_FILE, load_trained, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer

BUDGETS = (0.01, 0.05, 0.1, 0.2, 0.4)  # plus 1.0: the full cache
QUICK_BUDGETS = (0.05, 0.1)  # the acceptance's budgets
ACCEPT_BUDGET, ACCEPT_POINTS, WIN_BUDGETS = 0.1, 3.0, (0.05, 0.1)
METHODS = tuple(PRESSES)
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "world" / WEIGHTS_FILE


def parse(argv):
    desc = __doc__.split("\n")[0]
    p = argparse.ArgumentParser(prog="embodied-kv bench vlcache", description=desc)
    harness.add_common_args(p)
    p.add_argument("--weights", default=str(SHIPPED) if SHIPPED.is_file() else "",
                   help="trained world weights (QA rows); default: the shipped file if present")
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--questions", type=int, default=None, help="QA questions (1000; quick 12)")
    p.add_argument("--scenes", type=int, default=None, help="fidelity scenes (12; quick 3)")
    p.add_argument("--cameras", type=int, default=3, help="cameras of the long random world")
    p.add_argument("--image-size", type=int, default=None, help="its image size (96; quick 64)")
    p.add_argument("--layers", type=int, default=2, help="pi05: backbone / expert depth")
    p.add_argument("--vision-layers", type=int, default=2, help="pi05: SigLIP depth")
    p.add_argument("--batch", type=int, default=4, help="language requests per decode step")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (9; quick 5)")
    p.add_argument("--batches", default="", help="speed at each of these batches (comma-"
                   "separated; default: --batch alone)")
    p.add_argument("--speed-budgets", default="", help="speed budgets, comma-separated "
                   "(default: 0.1 with --quick, else every budget)")
    p.add_argument("--speed-only", action="store_true", help="the speed section alone (no "
                   "fidelity, no QA: gpu-check's mechanisms profile)")  # fmt: skip
    args = harness.parse(p, argv)
    args.questions = args.questions if args.questions is not None else (12 if args.quick else 1000)
    args.scenes = args.scenes if args.scenes is not None else (3 if args.quick else 12)
    args.image_size = args.image_size or (64 if args.quick else 96)
    args.repeats = args.repeats or (5 if args.quick else 9)
    if min(args.questions, args.cameras, args.batch, args.repeats) < 1 or args.scenes < 1:
        p.error("--questions, --scenes, --cameras, --batch and --repeats must be >= 1")
    return args


def long_world(args, tokenizer_dir: str):
    """The world preset at `--cameras` and `--image-size`, random weights: a long visual
    prefix (3 x 144 image rows at 96 px)."""
    cfg = world_config()
    cfg = dataclasses.replace(cfg, num_cameras=args.cameras,
                              vision=dataclasses.replace(cfg.vision, image_size=args.image_size))
    tok = save_tokenizer(Path(tokenizer_dir) / TOKENIZER_FILE)
    return build_model(cfg, args.device, tokenizer_path=str(tok))


def speed_model(args, world):
    """(model, prefix) the speed rows run on."""
    if args.preset == "pi05":
        cfg = get_preset("pi05", layers=args.layers, vision_layers=args.vision_layers)
        model = build_model(cfg, args.device)
        return model, model.embed_prefix(synthetic_observation(cfg, 0, "put the cup on the plate"))
    return world, vlcache_fidelity.world_prompts(world, 1)[0].prefix


def qa_rows(model, methods, budgets, questions: int) -> dict[str, list[tuple[str, bool]]]:
    """Scene-question outcomes through the Engine per method@budget (and full@1): (kind,
    right) per question, the same questions in the same order for every row."""
    cfg = EvalConfig(episodes=0, questions=questions, memory=0)
    base = make_engine(model, cfg).cfg  # eval world's engine settings, compression added
    out = {}
    for method in methods:
        for budget in budgets if method != "full" else [1.0]:
            compress = CompressConfig(budget=budget, method=method)
            engine = Engine(dataclasses.replace(base, compress=compress), model=model)
            out[f"{method}@{budget:g}"] = question_results(engine, cfg)
    return out


def verdict(qa: dict[str, float], outcomes: dict | None = None) -> tuple[bool, str]:
    """The acceptance: vlcache at 10% within 3 points of full; >= every other method at 5%
    and 10% (the losing rows named). With the per-question `outcomes`, the line also gives
    the paired standard error of the points lost (the gate itself is the point estimate)."""
    key = f"vlcache@{ACCEPT_BUDGET:g}"
    full, ours = qa["full@1"], qa[key]
    close = (full - ours) * 100 <= ACCEPT_POINTS
    se = ""
    if outcomes:
        right = [[ok for _, ok in outcomes[k]] for k in ("full@1", key)]
        se = f" ± {harness.paired_difference(*right)[1] * 100:.1f} SE"
    others = [m for m in METHODS if m not in ("full", "vlcache")]
    losses = [f"{m}@{b:g} {qa[f'{m}@{b:g}']:.3f} > vlcache {qa[f'vlcache@{b:g}']:.3f}"
              for b in WIN_BUDGETS for m in others if qa[f"{m}@{b:g}"] > qa[f"vlcache@{b:g}"]]
    ok = close and not losses
    n = f", {len(outcomes['full@1'])} questions" if outcomes else ""
    line = (f"VERDICT {'PASS' if ok else 'FAIL'}: vlcache@10% QA {ours:.3f} vs full {full:.3f} "
            f"({(full - ours) * 100:+.1f}{se} points lost{n}, need <= {ACCEPT_POINTS:g}: "
            f"{'ok' if close else 'no'}); vs every other method at 5%/10%: "
            f"{'ok' if not losses else 'loses to ' + '; '.join(losses)}")  # fmt: skip
    return ok, line


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = harness.Environment.start(args, argv)
    budgets = list(QUICK_BUDGETS if args.quick else BUDGETS)
    speed_budgets = [0.1] if args.quick else budgets
    if args.speed_budgets:
        speed_budgets = [float(b) for b in args.speed_budgets.split(",")]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    with tempfile.TemporaryDirectory() as tmp:
        world = long_world(args, tmp)
        model, prefix = speed_model(args, world)
        speeds = []
        for batch in batches:
            speeds.append(vlcache_speed.measure(model, prefix, speed_budgets, batch,
                                                args.repeats))  # fmt: skip
            harness.progress(env, f"speed at batch {batch} measured")
        speed = speeds[0]
        trained = None
        if args.weights and not args.speed_only:
            trained = load_trained(args.weights, args.tokenizer or None)
        fid_model = trained or world
        prompts, fidelity = [], {}
        if not args.speed_only:
            prompts = vlcache_fidelity.world_prompts(fid_model, args.scenes)
            fidelity = vlcache_fidelity.measure(fid_model, prompts, list(METHODS), budgets)
    outcomes = qa_rows(trained, METHODS, budgets, args.questions) if trained is not None else {}
    qa_kinds = {k: accuracy_of(v) for k, v in outcomes.items()}
    qa = {k: v["qa"] for k, v in qa_kinds.items()}

    pre = speed["prefill"]
    for other in speeds[1:]:
        print_table(["batch", "budget", "step ms", "full ms", "step x", "attn x"],
                    [[other["batch"], r["budget"], r["decode_step_ms"],
                      r["decode_step_full_ms"], r["decode_speedup"], r["attention_speedup"]]
                     for r in other["rows"]])  # fmt: skip
    print(f"speed ({env.device_name}, {args.preset}, prefix {speed['prefix_rows']} rows of which "
          f"{speed['image_rows']} image, batch {speed['batch']}): the recorder adds "
          f"{pre['overhead'] * 100:+.1f}% to a {pre['prefill_ms']:.1f} ms prefill (the action's "
          f"path; goal <= 5%), statistics and selection after the expert "
          f"{pre['overhead_total'] * 100:+.1f}% in all")  # fmt: skip
    print_table(
        ["budget", "rows/layer", "KV KiB", "full KiB", "step ms", "full ms", "step x", "attn x",
         "expert x"],
        [[r["budget"], "/".join(map(str, r["rows_per_layer"])), r["kv_bytes"] / 1024,
          r["kv_bytes_full"] / 1024, r["decode_step_ms"], r["decode_step_full_ms"],
          r["decode_speedup"], r["attention_speedup"], r["expert_speedup"]]
         for r in speed["rows"]],
    )  # fmt: skip
    which = f"trained weights {args.weights}" if trained else "random weights, long world"
    rows = prompts[0].prefix.embeds.shape[0] if prompts else 0
    print(f"\nfidelity vs the full cache ({which}, {len(prompts)} scenes, prefix {rows} rows)")
    print_table(
        ["method@budget", "top1", "greedy32 exact", "greedy32 prefix", "hit rate",
         "chunk err", "QA"],
        [[k, r["top1"], r["greedy32_exact"], r["greedy32_prefix"], r["hit_rate"],
          r["chunk_err"], qa.get(k, float("nan"))] for k, r in fidelity.items()],
    )  # fmt: skip
    result = {
        "benchmark": "vlcache", "preset": args.preset, "quick": args.quick,
        "weights": args.weights or None, "budgets": budgets, "speed": speed,
        "speed_batches": speeds,
        "fidelity": fidelity, "qa": qa, "qa_kinds": qa_kinds,
    }  # fmt: skip
    if qa:
        ok, line = verdict(qa, outcomes)
        if args.quick:  # a 3-point gate needs ~1,000 paired questions (SE ~1 point)
            line += f" [--quick: {args.questions} questions decide nothing; the full sweep does]"
        result["verdict"] = {"pass": ok, "line": line}
    else:
        line = "VERDICT n/a: no trained weights (--weights PATH) -> no QA rows; fidelity only"
    print("\n" + line)
    harness.finish(result, env, args.json)
    return 0
