"""`embodied-kv bench precision`: the bf16 action chunk's error against an fp32 run of the
same weights, the product's path beside the reference chain (issue #33's accuracy bar:
the fused path's error within 1.5x that of the path before the fusions).

One model in fp32 and one in bf16 with the fp32 model's weights (cast by `load_state_dict`
under the bf16 precision policy, model/precision.py). For each camera count and seed: the
same synthetic observation and noise through

    fp32        the fp32 model (the reference)
    bf16        the bf16 model through the fast path: the expert's fused layer-step
                (model/expert_step.py, whatever model/expert.py FUSED_LAYER_STEP picks for
                the product), SigLIP's fast encoder (model/vision_fast.py)
    bf16_ref    the bf16 model through the reference chain: the expert's unfused layer
                (torch ops, or its unfused kernels), HF's eager SigLIP forward

each an eager chunk from one prefill (bench/lerobot_peer.our_chunk; graph replay equals it in
bytes, test/engine/test_graphs.py). Per row: max |error| and rms error of each bf16 path
against fp32, and `ratio` = rms(bf16) / rms(bf16_ref); the verdict is on `pooled_ratio`,
the same over all seeds of a camera count (one chunk's error is noisy). On a CPU the fused
kernels do not run (their references do), so both bf16 paths differ only in the vision
tower: the code path, not the GPU's answer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch

from embodied_kv.bench import harness
from embodied_kv.bench.latency import observation
from embodied_kv.bench.lerobot_peer import our_chunk
from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model

GOAL_RATIO = 1.5


@contextlib.contextmanager
def reference_chain(model):
    """The model's bf16 reference chain while inside: the expert's layer-step unfused and
    SigLIP through HF's eager forward."""
    v, fused = model.vision, model.expert.fused_layer_step
    own = vars(v).get("forward")  # an instance attribute already (else the class's method)
    forward = v.forward
    v.forward = lambda images, reference=False: forward(images, reference=True)
    model.expert.fused_layer_step = False
    try:
        yield
    finally:
        model.expert.fused_layer_step = fused
        if own is None:
            del v.forward
        else:
            v.forward = own


def errors(chunk: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (chunk.float() - ref.float()).abs()
    return {"max_abs": float(d.max()), "rms": float(d.pow(2).mean().sqrt())}


def run(args, env: harness.Environment) -> dict:
    depth = args.layers or None
    cfg = get_preset(args.preset, depth, depth)
    m32 = build_model(cfg, args.device, torch.float32)
    m16 = build_model(cfg, args.device, torch.bfloat16)
    m16.load_state_dict(m32.state_dict())  # the same weights, cast as the policy keeps them
    m16.expert.fused_layer_step = True  # the fused kernels: the arithmetic that differs
    harness.progress(env, "fp32 and bf16 models built")
    seeds = range(args.seeds or (2 if args.quick else 4))
    cams_list = [c for c in range(1, cfg.num_cameras + 1) if args.preset != "pi05" or c >= 2]
    rows = []
    for cams in cams_list:
        for seed in seeds:
            obs, noise = observation(cfg, cams, 5000 + seed), m32.make_noise(seed)
            ref = our_chunk(m32, obs, noise)
            fused = our_chunk(m16, obs, noise.to(m16.device))
            with reference_chain(m16):
                chain = our_chunk(m16, obs, noise.to(m16.device))
            e, c = errors(fused, ref), errors(chain, ref)
            rows.append({"cameras": cams, "seed": seed, "bf16": e, "bf16_ref": c,
                         "chunk_rms": float(ref.pow(2).mean().sqrt()),
                         "ratio": e["rms"] / c["rms"] if c["rms"] else None})  # fmt: skip
        harness.progress(env, f"{cams} cameras")
    pooled = {c: pooled_ratio([r for r in rows if r["cameras"] == c]) for c in cams_list}
    ratios = [v for v in pooled.values() if v is not None]
    return {
        "benchmark": "precision", "preset": args.preset, "layers": args.layers or None,
        "rows": rows, "goal_ratio": GOAL_RATIO, "pooled_ratio": pooled,
        "worst_ratio": max(ratios) if ratios else None,
        "median_row_ratio": statistics.median(r["ratio"] for r in rows if r["ratio"]),
    }  # fmt: skip


def pooled_ratio(rows: list[dict]) -> float | None:
    """rms error over the rows' seeds, product path / reference chain (one chunk's bf16
    error is noisy; the verdict is on the pooled figure of each camera count)."""
    ref = sum(r["bf16_ref"]["rms"] ** 2 for r in rows)
    return (sum(r["bf16"]["rms"] ** 2 for r in rows) / ref) ** 0.5 if ref else None


def report(result: dict) -> None:
    print("cams seed  bf16 max|err|  bf16 rms  ref-chain max|err|  ref-chain rms  ratio")
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['cameras']:4} {r['seed']:4}  {r['bf16']['max_abs']:13.4g}  "
              f"{r['bf16']['rms']:8.4g}  {r['bf16_ref']['max_abs']:18.4g}  "
              f"{r['bf16_ref']['rms']:13.4g}  {ratio:>5}")  # fmt: skip
    worst = result["worst_ratio"]
    if worst is not None:
        verdict = "PASS" if worst <= result["goal_ratio"] else "FAIL"
        pooled = ", ".join(f"{v:.2f}x at {c} cameras" for c, v in result["pooled_ratio"].items())
        print(f"VERDICT {verdict}: the product path's bf16 rms error over the seeds is {pooled} "
              f"the reference chain's (goal <= {result['goal_ratio']}x; per chunk median "
              f"{result['median_row_ratio']:.2f}x)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embodied-kv bench precision", description=__doc__.split("\n")[0]
    )
    harness.add_common_args(p)
    p.add_argument("--seeds", type=int, default=0, help="seeds per camera count (0: 2 / 4)")
    p.add_argument("--layers", type=int, default=0, help="depth override (0: the preset's)")
    args = harness.parse(p, argv)
    return harness.execute(args, argv, run, report)


if __name__ == "__main__":
    sys.exit(main())
