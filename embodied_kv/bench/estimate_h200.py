"""The estimate refitted on the H200 (issue #33 item 6): estimate_calibration's per-kernel
cost model with the Triton GEMM kernels a class of their own, its constants pinned by the
2026-12-04 H200 profiler rows or fitted to that day's breakdowns, then applied to this
checkout's census for both of the expert's layer-steps.

Kernel classes (estimate_calibration's, two split off):

    gemm          a cuBLAS matmul (bf16; the fp32 ones at a pinned cost a call)
    triton_gemm   a Triton fused GEMM kernel (kernels/norm_qkv_rope.py, norm_gate_up.py,
                  gemm_residual.py): a single kernel of a GEMM's intensity
    packed        the prefill tile
    expert        the expert attention's split partials and their reduce
    expert_fused  the expert attention reducing its own splits (9fde0a2: one kernel)
    other         elementwise, norms, RoPE, copies, gathers: bandwidth-bound

Measured (bench/results/2026-12-04-nvidia-h200, RUNS.md): call 1 at 9fde0a2, the fused
layer-step's breakdown at 2 and 3 cameras and the chain's totals; call 3 at 408d8ee, the
fused breakdown and the chain's total at 2 cameras. The censuses of those commits, each
layer-step, are stored (RESULTS/census_<commit>_<layer-step>.json, census_commands.txt);
today's are recorded on each run (~4 min a layer-step here, 2 and 3 cameras).
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np

from embodied_kv.bench import estimate_calibration as cal
from embodied_kv.kernels import expert_attention as attention_kernels

RESULTS = Path("bench/results/2026-12-04-cpu-intel-xeon-2core")
H200_RESULTS = Path("bench/results/2026-12-04-nvidia-h200")
COMMITS = ("9fde0a2", "408d8ee")  # call 1 (latency.json), call 3 (latency_tuned.json)
MEASUREMENTS = {"9fde0a2": "latency.json", "408d8ee": "latency_tuned.json"}
PATHS = ("fused", "chain")  # the expert's layer-steps (model/expert.py FUSED_LAYER_STEP)
REGIONS = ("vision", "prefill", "denoise")
HBM_H200 = 4.8e12  # H200 HBM3e bytes/s (bf16 dense peak and fp32 as the H100's)
HBM_H100 = cal.HBM  # 3.35e12

# --- the constants: pinned by a profiler row (bench/results/2026-12-04-nvidia-h200/
# latency.txt, call 1's top-20 tables; kernel_sweep.txt, call 2) or fitted (`fit`, worst
# error 7.3 %) to FIT_ON: the breakdowns of call 1 and 3, the chain's denoise and total.
# Fitted: per kernel in a replayed graph, launch + ramp + tail + the gap to the next node
# (call 1's denoise took 114.9 us a layer-step, its 6 kernels' device time 107.5 us).
KERNEL_FIXED_S = 2.6e-6
# Fitted: HBM fraction of elementwise / norm / copy kernels, mostly short ones (the largest,
# the prefill's _gelu_gate_fwd, moves 69 MB in 16.6 us a call: 0.87).
OTHER_BW_EFF = 0.5
# Fitted: bf16 peak fraction of a compute-bound cuBLAS GEMM once ramped up (by their nvjet
# rows the prefill's four GEMMs a layer, 155 GFLOP at 704 rows, took 254 us of device time:
# priced 285 + fixed costs; SigLIP's four, 15.6 GFLOP at 512 rows, 42.2 us: 32.5 + fixed) ...
GEMM_COMPUTE_EFF = 0.85
# ... and its extra rows of work (estimate_calibration's GEMM_RAMP_ROWS). Fitted.
GEMM_RAMP_ROWS = 384
# Carried from the H100 (its LM head row; no H200 row streams weights through cuBLAS alone):
# HBM fraction of a weight-streaming cuBLAS GEMM.
GEMM_BW_EFF = 0.85
# Fitted: HBM fraction of the Triton fused GEMM kernels, which stream the expert's weights
# at 50 rows: 0.82 TB/s, the four of a 408d8ee layer-step 59.5 us with their fixed costs
# (the sweep: 57.6 at the tuned tiles). 9fde0a2's tiles took 1.2x that; the census has none.
TRITON_BW_EFF = 0.17
# Pinned: _prefill_tile_fwd 794.1 us / 18 calls = 44.1 us for its 42 key blocks of 16 rows
# (663 rows; at 3 cameras 59.3 us for 58 blocks: 1.02 us).
PACKED_STEP_S = 1.05e-6
# Pinned: one key-block step, or one split read by the reduce, of the expert attention's
# longest program: the sweep's partials + reduce (blocks_per_split=4 fused_reduce=False,
# 13.72 us) priced 13.2 us. Not fitted: the breakdowns alone take it to the grid's floor
# (worst 6.4 %), where the two kernels cost their bytes only (~11.8 us).
EXPERT_STEP_S = 0.3e-6
# Pinned: _expert_attention_partial with its fused reduce, 7026.0 us / 180 calls = 39.0 us a
# call of device time (2 cameras; 40.7 at 3), plus one fixed cost: its counters' fill
# (FillFunctor<int>, 180 calls, 0.9 us) and the gaps.
EXPERT_FUSED_S = 39.0e-6
# Pinned: an fp32 cuBLAS GEMM (the expert's in / out projections before kernels/flow_io.py):
# sgemm_largek 289.2 us / 20 calls = 14.5 us a call, plus the fixed cost.
FP32_GEMM_S = 14.5e-6


def params(hbm: float = HBM_H200) -> dict:
    return dict(
        hbm=hbm,
        kernel_fixed_s=KERNEL_FIXED_S,
        other_bw_eff=OTHER_BW_EFF,
        gemm_compute_eff=GEMM_COMPUTE_EFF,
        gemm_ramp_rows=GEMM_RAMP_ROWS,
        gemm_bw_eff=GEMM_BW_EFF,
        triton_bw_eff=TRITON_BW_EFF,
        packed_step_s=PACKED_STEP_S,
        expert_step_s=EXPERT_STEP_S,
    )


def in_h100_terms(p: dict) -> dict:
    """p for estimate_calibration.kernel_s, which divides bytes by its H100 bandwidth: the
    bandwidth fractions scaled by hbm / 3.35e12."""
    scale = p["hbm"] / cal.HBM
    return dict(p, gemm_bw_eff=p["gemm_bw_eff"] * scale, other_bw_eff=p["other_bw_eff"] * scale)


def kernel_s(k: dict, p: dict, p100: dict) -> float:
    """One kernel record priced with parameters p (p100: `in_h100_terms(p)`); the classes
    of estimate_calibration by its kernel_s."""
    fixed = p["kernel_fixed_s"]
    if k["cls"] == "triton_gemm":
        compute = k["flops"] / (p["gemm_compute_eff"] * cal.PEAK_BF16)
        return fixed + max(compute, k["bytes"] / (p["triton_bw_eff"] * p["hbm"]))
    if k["cls"] == "expert_fused":
        return fixed + EXPERT_FUSED_S
    if k["cls"] == "gemm" and k["fp32"] and k["rows"]:  # not the patch embedding's conv
        return fixed + FP32_GEMM_S
    return cal.kernel_s(k, p100)


def at_depth(by_depth: dict, region: str, depth: int) -> list[dict]:
    """A region's kernels at full depth from the censuses at depth 1 and 2 (as
    estimate_calibration.scaled_ms: fixed + per-layer x depth, the counts `n` so weighted)."""
    out = [dict(k, n=(2 - depth) * k["n"]) for k in by_depth["1"].get(region, [])]
    return out + [dict(k, n=(depth - 1) * k["n"]) for k in by_depth["2"].get(region, [])]


def regions(census: dict) -> dict:
    """{"cameras/text tokens": {region: kernels at full depth}} of a recorded census."""
    depth = {g: census["layers"] for g in REGIONS} | {"vision": census["vision_layers"]}
    return {
        cams: {g: at_depth(by_depth, g, depth[g]) for g in REGIONS}
        for cams, by_depth in census["cameras"].items()
    }


def region_ms(kernels: list[dict], p: dict) -> float:
    p100 = in_h100_terms(p)
    return 1e3 * sum(k["n"] * kernel_s(k, p, p100) for k in kernels)


def price(census: dict, host: dict, p: dict | None = None) -> dict:
    """{"cameras/text tokens": {vision, prefill, denoise, host, total}} in ms for a recorded
    census (no LM head: the action path runs none); host: {cameras: measured embed + host}."""
    p = p or params()
    out = {}
    for cams, by_region in regions(census).items():
        r = {g: region_ms(by_region[g], p) for g in REGIONS}
        r["host"] = host[int(cams.split("/")[0])]
        r["total"] = sum(r.values())
        out[cams] = r
    return out


# --- the measurements ----------------------------------------------------------------------


def measured(commit: str) -> dict:
    """{cameras: {vision, embed, prefill, denoise, host, total, graphs, chain_graphs}} of a
    commit's latency JSON (ms, medians): the fused layer-step's breakdown (synchronized per
    region; total its sum), its graphs total and the chain's (`graphs_unfused_ms`)."""
    out = {}
    for row in json.loads((H200_RESULTS / MEASUREMENTS[commit]).read_text())["rows"]:
        b = row["breakdown_ms"]
        out[row["cameras"]] = dict(
            vision=b["vision"], embed=b["embed_prefix"] - b["vision"], prefill=b["prefill"],
            denoise=b["denoise"], host=b["host/other"], total=row["breakdown_action_ms"],
            graphs=row["graphs_ms"]["median"], chain_graphs=row["graphs_unfused_ms"]["median"],
        )  # fmt: skip
    return out


def targets(commit: str, path: str) -> dict:
    """{cameras: {region: ms}} the estimate of (commit, layer-step) should reproduce. The
    chain was timed only whole, as a graphs total: its denoise is the fused path's less the
    difference of the two totals, and its total (in the breakdown's synchronized regions)
    likewise."""
    out = {}
    for cams, m in measured(commit).items():
        saved = m["graphs"] - m["chain_graphs"] if path == "chain" else 0.0
        out[cams] = dict(
            vision=m["vision"],
            prefill=m["prefill"],
            denoise=m["denoise"] - saved,
            total=m["total"] - saved,
        )
    return out


def host_ms(commit: str = "408d8ee") -> dict:
    """{cameras: the measured embedding (embed_prefix - vision) + host ms} of a commit's
    run, added to the estimate; a camera count it did not measure (408d8ee's 3, today's)
    its 2 cameras' plus 9fde0a2's change from 2 to 3 cameras."""
    host = {c: m["embed"] + m["host"] for c, m in measured(commit).items()}
    if 3 not in host:
        early = host_ms("9fde0a2")
        host[3] = host[2] + early[3] - early[2]
    return host


# --- recording: estimate_calibration's recorder, the layer-step chosen ---------------------


class FusedReduceSteps(int):
    """The loop steps of an expert attention whose tiles reduce their own splits (one
    kernel: 9fde0a2, or expert_attention.REDUCE "last"): an int that tells `_classify` its
    class. The persistent queue ("queue") is one kernel too, priced as the two launches'
    work (class expert) with one fixed cost."""


_CAL_CLASSIFY = cal._classify


def _classify(op: str, flops: float, nbytes: float, steps: int, region: str) -> str:
    """estimate_calibration's classes with the Triton GEMM kernels and the fused-reduce
    attention apart."""
    if isinstance(steps, FusedReduceSteps):
        return "expert_fused"
    cls = _CAL_CLASSIFY(op, flops, nbytes, steps, region)
    return "triton_gemm" if cls == "gemm" and op == "single_kernel" else cls


@contextmanager
def layer_step(fused: bool):
    """bench/estimate's census (of whichever tree is imported) with the expert's layer-step
    chosen, the five fused kernels or the chain, whatever the tree's default; each model's
    first census run once unrecorded before (what the code makes once per weights, not in
    an action: the flow modulation, SigLIP's fused q/k/v); the classes above."""
    from embodied_kv.bench import estimate as est
    from embodied_kv.bench.kernel_census import Census

    census, attention = est.action_census, est.expert_attention_cost
    warm = weakref.WeakSet()

    def action_census(model, *args, **kwargs):
        model.expert.fused_layer_step = fused
        if model not in warm:
            warm.add(model)
            with mock.patch.object(est, "Census", Census):  # not the recorder's
                census(model, *args, **kwargs)
        return census(model, *args, **kwargs)

    def expert_attention_cost(*args, **kwargs):
        costs = attention(*args, **kwargs)
        if len(costs) == 1 and attention_kernels.REDUCE == "last":  # the last split reduces
            flops, nbytes, steps = costs[0]
            return [(flops, nbytes, FusedReduceSteps(steps))]
        return costs

    with (
        mock.patch.object(est, "action_census", action_census),
        mock.patch.object(est, "expert_attention_cost", expert_attention_cost),
        mock.patch.object(cal, "_classify", _classify),
    ):
        yield


def record(fused: bool, cameras=(2, 3)) -> dict:
    """estimate_calibration.record (the measured prefixes) with the layer-step chosen."""
    cases = tuple((c, cal.MEASURED_PREFIX[c] - 256 * c) for c in cameras)
    with layer_step(fused):
        out = cal.record(cases)
    out["layer_step"] = "fused" if fused else "chain"
    return out


# --- fitting ------------------------------------------------------------------------------
FITTED = ("kernel_fixed_s", "other_bw_eff", "gemm_compute_eff", "gemm_ramp_rows", "triton_bw_eff")
FIT_GRID = (
    tuple(x * 1e-7 for x in range(16, 41, 2)),
    tuple(x / 100 for x in range(20, 91, 5)),
    tuple(x / 100 for x in range(40, 96, 5)),
    (0, 64, 128, 192, 256, 384, 512, 768),
    tuple(x / 100 for x in range(10, 26)),
)
TIE = 0.002  # worst errors this close to the least are ties (the fit's second criterion)
# the fitted constants each class's price reads (`kernel_s`), besides kernel_fixed_s
USES = {
    "gemm": ("gemm_compute_eff", "gemm_ramp_rows"),
    "triton_gemm": ("gemm_compute_eff", "triton_bw_eff"),
    "packed": ("gemm_compute_eff", "other_bw_eff"),
    "expert": ("gemm_compute_eff", "other_bw_eff", "expert_step_s"),
    "expert_fused": (),
    "other": ("other_bw_eff",),
}
# what the fit reproduces, per (commit, layer-step): the fused path's regions; the chain's
# denoise (by difference) and total
FIT_ON = {
    ("9fde0a2", "fused"): REGIONS,
    ("408d8ee", "fused"): REGIONS,
    ("9fde0a2", "chain"): ("denoise", "total"),
    ("408d8ee", "chain"): ("denoise", "total"),
}


def stored() -> dict:
    """{(commit, layer-step): census} of the measured code."""
    return {(c, s): cal.load(RESULTS / f"census_{c}_{s}.json") for c in COMMITS for s in PATHS}


def estimates(censuses: dict, p: dict | None = None) -> dict:
    """{(commit, layer-step): priced at the measured prefixes with that run's host term}."""
    return {(c, s): price(census, host_ms(c), p) for (c, s), census in censuses.items()}


def errors(estimated: dict) -> dict:
    """{(commit, layer-step, cameras): {region: estimate / measured - 1}} over FIT_ON."""
    out = {}
    for (commit, path), names in FIT_ON.items():
        for cams, meas in targets(commit, path).items():
            est = estimated[(commit, path)][key(cams)]
            out[(commit, path, cams)] = {g: est[g] / meas[g] - 1 for g in names}
    return out


def worst(estimated: dict) -> float:
    return max(abs(e) for r in errors(estimated).values() for e in r.values())


def key(cams: int) -> str:
    """The census key of the measured prefix at `cams` cameras ("2/151", "3/153")."""
    return f"{cams}/{cal.MEASURED_PREFIX[cams] - 256 * cams}"


def grid_ms(kernels: list[dict]) -> np.ndarray:
    """region_ms over the whole FIT_GRID (one axis per FITTED constant, the others as
    committed): each class priced by kernel_s on the grid of the constants it reads only,
    then broadcast and summed."""
    total = np.zeros([len(v) for v in FIT_GRID])
    for cls in USES:
        ks = [k for k in kernels if k["cls"] == cls]
        axes = sorted(FITTED.index(n) for n in ("kernel_fixed_s", *USES[cls]) if n in FITTED)
        sub = np.empty([len(FIT_GRID[a]) for a in axes])
        for idx in np.ndindex(sub.shape):
            at = {FITTED[a]: FIT_GRID[a][i] for a, i in zip(axes, idx, strict=True)}
            sub[idx] = region_ms(ks, dict(params(), **at))
        shape = [len(v) if a in axes else 1 for a, v in enumerate(FIT_GRID)]
        total = total + sub.reshape(shape)
    return total


def fit(censuses: dict) -> dict:
    """Grid search of the FITTED constants (the others pinned) minimising the worst error of
    FIT_ON (ties: the least sum of squared errors); ~2 s. Shows where the committed
    constants come from."""
    worst_err, squares = np.zeros([len(v) for v in FIT_GRID]), 0.0
    for (commit, path), names in FIT_ON.items():
        by_cams = regions(censuses[(commit, path)])
        for cams, meas in targets(commit, path).items():
            est = {g: grid_ms(by_cams[key(cams)][g]) for g in REGIONS}
            est["total"] = sum(est.values()) + host_ms(commit)[cams]
            for g in names:
                err = est[g] / meas[g] - 1
                worst_err, squares = np.maximum(worst_err, np.abs(err)), squares + err**2
    # the least worst error; among the points within TIE of it, the least sum of squares
    squares = np.where(worst_err <= worst_err.min() + TIE, squares, np.inf)
    best = np.unravel_index(np.argmin(squares), squares.shape)
    fitted = {n: FIT_GRID[a][i] for a, (n, i) in enumerate(zip(FITTED, best, strict=True))}
    return dict(params(), **fitted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="estimate_h200", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="today's census at 2 cameras only")
    p.add_argument("--json", help="write the tables and the constants here")
    p.add_argument("--fit", action="store_true", help="re-run the grid fit on the stored censuses")
    p.add_argument("--record", help="record this tree's census (measured prefixes) and stop")
    p.add_argument("--layer-step", choices=PATHS, default="chain", help="with --record")
    a = p.parse_args(argv)
    if a.record:
        out = record(a.layer_step == "fused")
        Path(a.record).write_text(json.dumps(out, separators=(",", ":")))
        return 0
    censuses = stored()
    if a.fit:
        p_fit = fit(censuses)
        got = worst(estimates(censuses, p_fit))
        print("fit:", {k: p_fit[k] for k in FITTED}, f"worst {100 * got:.1f} %")
    from embodied_kv.bench.estimate_floor import (
        floor_rows,
        measured_floor,
        print_floor,
        print_measured_floor,
    )
    from embodied_kv.bench.estimate_h200_tables import fitted_rows, print_tables, today_rows

    estimated = estimates(censuses)
    fitted = fitted_rows(estimated)
    cams = (2,) if a.quick else (2, 3)
    recorded = {s: record(s == "fused", cams) for s in PATHS}
    today = today_rows(recorded)
    print_tables(fitted, today, worst(estimated))
    floor = {hbm: floor_rows(recorded, hbm) for hbm in (HBM_H200, HBM_H100)}
    print_floor(floor[HBM_H200], floor[HBM_H100])
    measured_rows = measured_floor()
    print_measured_floor(measured_rows)
    if a.json:
        out = dict(params=params(), worst_error=worst(estimated), fitted=fitted, today=today,
                   floor=floor[HBM_H200], floor_h100=floor[HBM_H100],
                   measured_floor=measured_rows)  # fmt: skip
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
