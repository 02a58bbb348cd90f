"""The H100 estimate calibrated on the measured H100 (issue #33 item 6): per-kernel-class
costs fitted to the 2026-11-22 profiler table and breakdown of commit 97dd254, then applied
to the census of this checkout.

The census (bench/estimate.py: `action_census` at depth 1 and 2, `scaled` to 18 / 27
layers) is re-recorded here kernel by kernel, each kernel put in one class:

    gemm       a matmul (bf16 or fp32) or a fused GEMM kernel (norm->qkv->rope, ...)
    packed     the backbone's packed attention / prefill tile (a loop over key blocks)
    expert     the action expert's attention (a loop over key blocks)
    other      elementwise, norms, RoPE, copies, gathers: bandwidth-bound

and priced with the constants below: fixed cost + max(compute, memory, loop chain).
The censuses of the measured code are stored (bench/results/2026-11-26-cpu-intel-xeon-2core/
census_97dd254.json, census_133f594.json: `--record` run from a worktree of that commit,
census_commands.txt); today's is recorded on each run (~30 s for 2 and 3 cameras).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path("bench/results/2026-11-26-cpu-intel-xeon-2core")
STORED = RESULTS / "census_97dd254.json"  # the code of the 11-22 breakdown
STORED_133F594 = RESULTS / "census_133f594.json"  # the code of the 11-23 25.5 ms
# bench/results/2026-11-22-nvidia-h100-80gb-hbm3/latency.txt, graphs engine, median ms;
# prefill there includes the logits of the last row bucket; embed = embed_prefix - vision
MEASURED_1122 = {
    2: {"vision": 3.93, "embed": 5.1 - 3.93, "prefill": 8.37, "denoise": 15.0, "host": 0.462},
    3: {"vision": 5.1, "embed": 6.45 - 5.1, "prefill": 9.57, "denoise": 15.2, "host": 0.509},
}
MEASURED_1122_ACTION_MS = {2: 27.6, 3: 30.1}
# the prefix rows of those runs (the byte tokenizer makes the prompt ~150 tokens)
MEASURED_PREFIX = {2: 663, 3: 921}
MEASURED_1123_ACTION_MS = {2: 25.5, 3: 28.1}  # 2026-11-23 latency.txt, commit 133f594
PEAK_BF16 = 989e12  # H100 SXM dense bf16 tensor cores
PEAK_FP32 = 67e12  # fp32 GEMMs (TF32 off): gemmSN / sgemm_largek rows of the profiler table
HBM = 3.35e12  # H100 SXM HBM3 bytes/s

# --- the cost model's constants: pinned by a profiler row, or fitted (`fit`) to the
# 2026-11-22 breakdown of 97dd254 (vision, prefill incl. logits, denoise at 2 and 3
# cameras; worst region error 4.9 %). The profiler table (action_breakdown.txt) is of
# f9f0b61, the same code but for the expert attention, which 97dd254 split.
# Fitted: per kernel in a replayed graph, launch + ramp + tail + the gap to the next node
# (the table's smallest kernels, _rope_fwd 1.46 us and _rms_norm_fwd 1.82 us a call, are
# this cost less the gap).
KERNEL_FIXED_S = 2.4e-6
# Fitted: HBM fraction of elementwise / norm / copy kernels (the table's at::native
# elementwise kernels, 2.6-6.1 us a call, are mostly short ones far from streaming speed).
OTHER_BW_EFF = 0.40
# Pinned: HBM fraction of a weight-streaming GEMM: the LM head (257,152 x 2048 bf16,
# 1.05 GB) took 367.9 us a call (nvjet 256x8, 3 calls) = 2.86 TB/s = 0.85 of 3.35.
GEMM_BW_EFF = 0.85
# Fitted: bf16 peak fraction of a compute-bound GEMM once ramped up ...
GEMM_COMPUTE_EFF = 0.85
# ... which pays for GEMM_RAMP_ROWS extra rows of work (wave quantisation on 132 SMs, the
# pipeline's fill): t = 2 K N (M + RAMP) / (eff x peak). Fitted; with it the prefill's
# GEMMs cost 269 us a layer at 704 rows, the table's 262 us (2 x 66 + 101 + 2 x 14.6) and
# the prefill grows 2 -> 3 cameras as measured (+1.2 ms, not the +2.7 of M-linear work).
GEMM_RAMP_ROWS = 256
# Pinned: one key-block step of the prefill tile's longest program: _prefill_tile_fwd
# 43.5 us a call (18 a layer x 3 actions) over its 42 blocks of 16 keys (663 rows).
PACKED_STEP_S = 1.04e-6
# Pinned: one key-block step of the expert attention's longest program: the unsplit
# _expert_attention_fwd of f9f0b61, 83 us a call for 52 steps (estimate.py's
# STEP_LATENCY_S note).
EXPERT_STEP_S = 1.6e-6
# Measured, not priced: the embedding (eager, launch-bound) and host work of the 11-22
# breakdown (embed_prefix - vision + host/other), added to every estimate's total.
HOST_MS = {2: 5.1 - 3.93 + 0.462, 3: 6.45 - 5.1 + 0.509}
CLASSES = ("gemm", "packed", "expert", "other")
GEMM_OPS = ("mm", "addmm", "bmm", "linear", "baddbmm", "convolution")


def params() -> dict:
    return dict(
        kernel_fixed_s=KERNEL_FIXED_S,
        other_bw_eff=OTHER_BW_EFF,
        gemm_bw_eff=GEMM_BW_EFF,
        gemm_compute_eff=GEMM_COMPUTE_EFF,
        gemm_ramp_rows=GEMM_RAMP_ROWS,
        packed_step_s=PACKED_STEP_S,
        expert_step_s=EXPERT_STEP_S,
    )


def kernel_s(k: dict, p: dict) -> float:
    """One kernel record (class, flops, bytes, steps, fp32) priced with parameters p."""
    fixed = p["kernel_fixed_s"]
    if k["cls"] == "gemm":
        peak = PEAK_FP32 if k["fp32"] else PEAK_BF16
        # K x N (the weights); a fused GEMM kernel's rows are not recorded: its weights are
        # most of its bytes (the expert's, M ~ 50)
        kn = k["flops"] / (2 * k["rows"]) if k.get("rows") else k["bytes"] / 2
        flops = k["flops"] + 2 * kn * p["gemm_ramp_rows"]
        return fixed + max(
            flops / (p["gemm_compute_eff"] * peak), k["bytes"] / (p["gemm_bw_eff"] * HBM)
        )
    mem = k["bytes"] / (p["other_bw_eff"] * HBM)
    if k["cls"] in ("packed", "expert"):
        step = p["packed_step_s"] if k["cls"] == "packed" else p["expert_step_s"]
        compute = k["flops"] / (p["gemm_compute_eff"] * PEAK_BF16)
        return fixed + max(compute, mem, k["steps"] * step)
    return fixed + mem


def region_ms(kernels: list[dict], p: dict) -> float:
    """Sum of a captured region's kernels (each record has a count `n`)."""
    return 1e3 * sum(k["n"] * kernel_s(k, p) for k in kernels)


def scaled_ms(by_depth: dict, region: str, p: dict, layers: int, vision_layers: int) -> float:
    """Fixed + per-layer x depth from the censuses at depth 1 and 2 (as estimate.scaled)."""
    one = region_ms(by_depth["1"].get(region, []), p)
    two = region_ms(by_depth["2"].get(region, []), p)
    depth = vision_layers if region == "vision" else layers
    return (one - (two - one)) + (two - one) * depth


def price(census: dict, p: dict | None = None, logits: bool = True) -> dict:
    """{"cameras/text tokens": {vision, prefill (incl. logits, as the H100 breakdown),
    denoise, host (HOST_MS), total}} in ms for a recorded census (see `record`). `logits`
    False drops the LM head: bench/estimate's census runs it, today's action path does not."""
    p = p or params()
    out = {}
    for cams, by_depth in census["cameras"].items():
        r = {
            g: scaled_ms(by_depth, g, p, census["layers"], census["vision_layers"])
            for g in ("vision", "prefill", "logits", "denoise")
        }
        r["prefill"] += r.pop("logits") if logits else 0.0
        r.pop("logits", None)
        r["host"] = HOST_MS[int(cams.split("/")[0])]
        r["total"] = sum(r.values())
        out[cams] = r
    return out


# --- recording: the census kernel by kernel (works on this tree and on 97dd254's) --------


def _classify(op: str, flops: float, nbytes: float, steps: int, region: str) -> str:
    if steps:
        return "expert" if region == "denoise" else "packed"
    name = op.split(".")[1] if op.startswith("aten.") else op  # aten.mm.default -> mm
    if flops and (name in GEMM_OPS or op == "single_kernel" and flops > 20 * nbytes):
        return "gemm"  # the fused norm->GEMM kernels: single kernels of a GEMM's intensity
    return "other"


def _gemm_rows(func, args) -> int:
    """M of a matmul: the rows of its left operand (addmm / baddbmm: the second argument)."""
    name = str(func).split(".")[1] if str(func).startswith("aten.") else ""
    if name not in GEMM_OPS or name == "convolution":
        return 0
    a = args[1] if name in ("addmm", "baddbmm") else args[0]
    return a.numel() // a.shape[-1] if a.dim() else 0


@contextmanager
def recording(est):
    """Patch `est` (a bench/estimate module) so that its Census also keeps every kernel;
    yields the list of records the census appends to. The old tree's attention costs carry
    no loop steps: they are added here from the same shapes (key blocks of 16 rows)."""
    import embodied_kv.bench.kernel_census as kc

    records: list = []

    new_tree = "serial_steps" in kc.Census._add.__code__.co_varnames

    class Recorder(kc.Census):
        @contextmanager
        def single_kernel(self, cost):  # as this tree's: (FLOPs, bytes[, loop steps]) each;
            # one inside another is part of it (a persistent kernel's phases)
            old, self._muted = self._muted, True
            try:
                yield
                costs = [] if old else cost()
            finally:
                self._muted = old
            for c in costs if isinstance(costs, list) else [costs]:
                self._add("single_kernel", c[0], c[1], serial_steps=c[2] if len(c) > 2 else 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._rows = _gemm_rows(func, args)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _add(self, op, flops, nbytes, syncs=0, fp32=False, serial_steps=0):
            if self._region is not None and not syncs:
                cls = _classify(op, flops, nbytes, serial_steps, self._region)
                rows = getattr(self, "_rows", 0) if op != "single_kernel" else 0
                records.append(
                    (self._region, cls, float(flops), float(nbytes), int(serial_steps), fp32, rows)
                )
            if new_tree:
                return super()._add(op, flops, nbytes, syncs, fp32, serial_steps=serial_steps)
            return super()._add(op, flops, nbytes, syncs, fp32)

    real = est.Census, est.attention_cost, est.expert_attention_cost
    old_tree = not new_tree

    def packed(q, k_cache, slot, kv_len):
        c = real[1](q, k_cache, slot, kv_len)
        if old_tree:  # the prefill tile: its longest program walks kv_len / BLOCK_N blocks
            bn = est.tile_config(q.dtype, q.shape[1] // k_cache.shape[2]).block_n
            return (*c, -(-int(kv_len.max()) // bn))
        return c

    def expert(q, kp, vp, ks, vs, scale, bias, *rest, **kwargs):
        c = real[2](q, kp, vp, ks, vs, scale, bias, *rest, **kwargs)
        if old_tree:  # split partials (steps: a prefix chunk's blocks, or the suffix's), reduce
            bn = est.tile_config(q.dtype, q.shape[1] // kp.shape[1]).block_n
            blocks = -(-kp.shape[0] // bn)
            chunk = -(-blocks // (est.split_count(kp.shape[0], bn) - 1))
            steps = max(chunk, -(-q.shape[0] // bn))
            return [(*c[0], steps), c[1]]
        return c

    est.Census, est.attention_cost, est.expert_attention_cost = Recorder, packed, expert
    try:
        yield records
    finally:
        est.Census, est.attention_cost, est.expert_attention_cost = real


def record(cases=((2, MEASURED_PREFIX[2] - 512), (3, MEASURED_PREFIX[3] - 768))) -> dict:
    """Run bench/estimate's census (graph-padded, as the graphs engine runs) at depth 1 and
    2 for each (cameras, text tokens) and keep each kernel; identical kernels are stored
    once with a count. Keys "cameras/text tokens"."""
    import gc

    import torch

    from embodied_kv.bench import estimate as est
    from embodied_kv.model.config import get_preset
    from embodied_kv.model.vla import build_model

    torch.set_num_threads(1)
    full = get_preset("pi05")
    out: dict = {"layers": full.backbone.layers, "vision_layers": full.vision.layers}
    cams_out: dict = {}
    for depth in (1, 2):
        model = build_model(
            get_preset("pi05", layers=depth, vision_layers=depth), "cpu", dtype=torch.bfloat16
        )
        try:
            from embodied_kv.model.fused import fuse_projections

            fuse_projections(model)
        except ImportError:  # 97dd254 fused nothing on the CPU
            pass
        for cams, text in cases:
            with recording(est) as records:
                est.action_census(model, cams, text, True)
            by_region: dict = {}
            for (region, *key), n in Counter(records).items():
                cls, flops, nbytes, steps, fp32, rows = key
                by_region.setdefault(region, []).append(
                    dict(cls=cls, flops=flops, bytes=nbytes, steps=steps, fp32=fp32, rows=rows, n=n)
                )
            cams_out.setdefault(f"{cams}/{text}", {})[str(depth)] = by_region
        del model
        gc.collect()
    out["cameras"] = cams_out
    return out


# --- fitting ------------------------------------------------------------------------------
FITTED = ("gemm_ramp_rows", "kernel_fixed_s", "gemm_compute_eff", "other_bw_eff")
FIT_GRID = (
    (0, 32, 64, 128, 192, 256, 384, 512),
    tuple(x * 2e-7 for x in range(8, 21)),
    tuple(x / 100 for x in range(40, 91, 5)),
    tuple(x / 100 for x in range(20, 91, 5)),
)


def errors(priced: dict) -> dict:
    """Per census key and region: estimate / measured (11-22) - 1."""
    return {
        c: {
            g: priced[c][g] / MEASURED_1122[int(c.split("/")[0])][g] - 1
            for g in ("vision", "prefill", "denoise")
        }
        for c in priced
    }


def worst(priced: dict) -> float:
    return max(abs(e) for r in errors(priced).values() for e in r.values())


def fit(census: dict) -> dict:
    """Grid search of the FITTED constants (the others pinned) minimising the worst region
    error at 2 and 3 cameras; ~3 s. Shows where the committed constants come from."""
    import itertools

    best = None
    for vals in itertools.product(*FIT_GRID):
        p = dict(params(), **dict(zip(FITTED, vals, strict=True)))
        w = worst(price(census, p))
        if best is None or w < best[0]:
            best = (w, p)
    return best[1]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def table(old: dict, later: dict, today: dict) -> list[dict]:
    """Rows: measured 11-22, the calibrated 97dd254 estimate and its error, the 133f594
    estimate against the 11-23 measurement (totals only), today's estimate at the
    measured prefix and at the limit's 48-token prompt."""
    rows = []
    for cams in (2, 3):
        key = f"{cams}/{MEASURED_PREFIX[cams] - 256 * cams}"
        short = f"{cams}/48"
        for g in ("vision", "prefill", "denoise", "host", "total"):
            meas = MEASURED_1122_ACTION_MS[cams] if g == "total" else MEASURED_1122[cams].get(g)
            if g == "host":
                meas = HOST_MS[cams]
            est = old[key][g]
            rows.append(
                dict(
                    cameras=cams,
                    region=g,
                    measured_1122_ms=meas,
                    calibrated_97dd254_ms=est,
                    error_pct=100 * (est / meas - 1),
                    measured_1123_ms=MEASURED_1123_ACTION_MS[cams] if g == "total" else None,
                    calibrated_133f594_ms=later[key][g] if key in later else None,
                    today_ms=today[key][g] if key in today else None,
                    today_48_ms=today[short][g] if short in today else None,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="estimate_calibration", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="today's census at 2 cameras only")
    p.add_argument("--json", help="write the table and the constants here")
    p.add_argument("--record", help="record this tree's census (measured prefixes) and stop")
    p.add_argument("--fit", action="store_true", help="re-run the grid fit on the 97dd254 census")
    a = p.parse_args(argv)
    if a.record:
        Path(a.record).write_text(json.dumps(record(), separators=(",", ":")))
        return 0
    old, later = load(STORED), load(STORED_133F594)
    if a.fit:
        fitted = fit(old)
        print(
            "fit:", {k: fitted[k] for k in FITTED}, f"worst {100 * worst(price(old, fitted)):.1f} %"
        )
    cams = (2,) if a.quick else (2, 3)
    cases = [(c, t) for c in cams for t in (MEASURED_PREFIX[c] - 256 * c, 48)]
    priced = price(record(tuple(cases)), logits=False)  # no LM head on today's action path
    rows = table(price(old), price(later), priced)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print("cams region   meas_11-22  est_97dd254   err%  meas_11-23  est_133f594  today  today@48")
    for r in rows:
        print(
            f"{r['cameras']:>4} {r['region']:<8} {fmt(r['measured_1122_ms']):>10} "
            f"{fmt(r['calibrated_97dd254_ms']):>12} {r['error_pct']:>6.1f} "
            f"{fmt(r['measured_1123_ms']):>11} {fmt(r['calibrated_133f594_ms']):>12} "
            f"{fmt(r['today_ms']):>6} {fmt(r['today_48_ms']):>9}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"params": params(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
