"""Every GEMM shape of a pi05 action timed as the product runs it (cuBLAS through F.linear)
beside other ways to run the same product: does any beat the rate the calibrated estimate
was fitted to?

    python -m embodied_kv.bench.gemm_sweep --json PATH [--budget-s 20] [--dry]

Why: the estimate's floor (bench/estimate_floor.py) is the GEMMs alone at the fitted
cuBLAS rate, 10.3 ms at 2 cameras with the measured host term, above issue 33's 10 ms:
only GEMMs measured faster than that rate can take the action there. The 2026-12-04 H200
profile ran the prefill's q/k/v and o GEMMs at 40-50 % of the bf16 peak (nvjet tiles of
224x64 and 176x64 at 704 rows: fewer tiles than SMs) and down at 52 %, where gate/up
reached 73 %.

Shapes (pi05): the prefill's four GEMMs a layer at the prefix of 2 and 3 cameras (the step
buckets 704 and 960 rows), SigLIP's four at 512 rows (two cameras batched) and the action
expert's four at 50 rows. Candidates, each timed as a CUDA graph over 18 layers' weights
(rotated, so they come from HBM, not L2), median of replays, per call:

    linear      F.linear, as the product calls it (torch's default BLAS library)
    cublaslt    the same under torch.backends.cuda.preferred_blas_library("cublaslt")
    pad128      the rows padded to a multiple of 128 (another tile choice; extra rows' work)
    split_n2    two GEMMs over the halves of N on two streams (fills SMs a short grid
                leaves idle: the prefill's q/k/v, o and down)
    split_k2    two GEMMs over the halves of K on two streams, then their sum (down)

Each candidate is checked against an fp32 GEMM of the same inputs (relative error; over 2x
linear's is marked wrong and not ranked). The JSON has per shape the estimate's fitted price,
each candidate's time and TFLOP/s, and per region the action's GEMM time as the product runs
it against the best candidate per shape: what the estimate's floor becomes at measured rates.

`--dry`: tiny shapes on the CPU in fp32, every candidate checked, nothing timed (the CI test).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from embodied_kv.bench import estimate_calibration as cal
from embodied_kv.bench import estimate_h200 as h2
from embodied_kv.bench.estimate_floor import gemm_ms, shapes
from embodied_kv.bench.kernel_sweep import rel_err, time_graph

LAYERS = 18  # weight sets rotated in a graph (the backbone's and the expert's depth)


def estimate_us(s: dict) -> float:
    """The calibrated estimate's price of one call (H200 constants, cuBLAS class, its fixed
    cost left out: the floor's term, estimate_floor.gemm_ms)."""
    k = dict(cls="gemm", n=1, flops=2.0 * s["m"] * s["n"] * s["k"], rows=s["m"], fp32=False,
             bytes=2.0 * (s["m"] * s["k"] + s["k"] * s["n"] + s["m"] * s["n"]))  # fmt: skip
    return 1e3 * gemm_ms([k], h2.params())


@contextmanager
def blas(library: str | None):
    """torch's preferred BLAS library for the block (None: as it is)."""
    if library is None or not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def side_stream():
    return torch.cuda.Stream() if torch.cuda.is_available() else None


def two_streams(side, first, second):
    """first() on the current stream, second() on `side` forked and joined here (in a
    capture: two branches of the graph); on the CPU (side None) one after the other."""
    if side is None:
        return first(), second()
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    a = first()
    with torch.cuda.stream(side):
        b = second()
    main.wait_stream(side)
    return a, b


def linear(L):
    return lambda: F.linear(L["x"], L["w"], L["b"])


def candidates(s: dict) -> list[tuple[str, object, str | None]]:
    """[(label, make(L) -> call() -> output [m, n], BLAS library or None)] for a shape (L: a
    layer's x, w, bias)."""
    m, n, k = s["m"], s["n"], s["k"]
    out = [("linear", linear, None), ("cublaslt", linear, "cublaslt")]
    if m % 128:

        def pad(L):
            xp = torch.zeros(-(-m // 128) * 128, k, dtype=L["x"].dtype, device=L["x"].device)
            xp[:m].copy_(L["x"])
            return lambda: F.linear(xp, L["w"], L["b"])[:m]

        out.append(("pad128", pad, None))
    if n % 2 == 0:

        def split_n(L):
            w1, w2 = L["w"].chunk(2, 0)
            b1, b2 = (None, None) if L["b"] is None else L["b"].chunk(2)
            side = side_stream()
            return lambda: torch.cat(two_streams(side, lambda: F.linear(L["x"], w1, b1),
                                                 lambda: F.linear(L["x"], w2, b2)), 1)  # fmt: skip

        out.append(("split_n2", split_n, None))
    if k % 2 == 0 and k >= 2 * n:  # a long reduction: down, the expert's o, SigLIP's fc2

        def split_k(L):
            x1, x2 = L["x"].chunk(2, 1)
            w1, w2 = L["w"].chunk(2, 1)
            side = side_stream()
            return lambda: torch.add(*two_streams(side, lambda: F.linear(x1, w1, L["b"]),
                                                  lambda: F.linear(x2, w2)))  # fmt: skip

        out.append(("split_k2", split_k, None))
    return out


def layer_inputs(s: dict, layers: int, dtype, device) -> list[dict]:
    x = torch.randn(s["m"], s["k"], device=device).to(dtype)  # the activations: one copy
    return [{"x": x, "w": (torch.randn(s["n"], s["k"], device=device) * s["k"] ** -0.5).to(dtype),
             "b": (0.1 * torch.randn(s["n"], device=device)).to(dtype) if s["bias"] else None}
            for _ in range(layers)]  # fmt: skip


def measure(s: dict, cuda: bool, repeats: int, deadline: float) -> dict:
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    layers = layer_inputs(s, LAYERS if cuda else 1, dtype, device)
    L0 = layers[0]
    ref = F.linear(L0["x"].double(), L0["w"].double(),
                   None if L0["b"] is None else L0["b"].double())  # fmt: skip
    flops = 2.0 * s["m"] * s["n"] * s["k"]
    row = dict(s, flops=flops, estimate_us=estimate_us(s), candidates={})
    for label, make, library in candidates(s):
        if time.perf_counter() > deadline:
            row["stopped"] = "budget reached"
            break
        cand = {}
        try:
            with blas(library):
                cand["err"] = rel_err(make(L0)(), ref)
                # linear: finite; the others within twice its error (fp32: 1e-5)
                bound = 1.0 if label == "linear" else max(2 * row["linear_err"], 1e-5)
                cand["ok"] = cand["err"] <= bound
                if cuda and cand["ok"]:
                    cand["us"] = time_graph([make(L) for L in layers], repeats)
                    cand["tflops"] = flops / cand["us"] * 1e-6
                    cand["of_peak"] = flops / (cand["us"] * 1e-6) / cal.PEAK_BF16
        except Exception as e:  # noqa: BLE001 - recorded: a config may not run on this torch
            cand["error"] = repr(e)[:300]
        if label == "linear":
            row["linear_err"] = cand.get("err", float("inf"))
        row["candidates"][label] = cand
    timed = {k: c for k, c in row["candidates"].items() if c.get("ok") and "us" in c}
    if "linear" in timed:
        best = min(timed, key=lambda k: timed[k]["us"])
        row["best"], row["best_us"] = best, timed[best]["us"]
        row["best_over_linear"] = timed["linear"]["us"] / timed[best]["us"]
    return row


def totals(rows: list[dict]) -> dict:
    """Per region: an action's GEMM ms as the estimate's floor prices them, as F.linear ran
    them and with the best candidate per shape."""
    out = {}
    for r in rows:
        t = out.setdefault(r["region"], {"estimate_ms": 0.0, "linear_ms": 0.0, "best_ms": 0.0})
        t["estimate_ms"] += r["calls"] * r["estimate_us"] * 1e-3
        lin = r["candidates"].get("linear", {}).get("us")
        t["linear_ms"] += r["calls"] * (lin if lin is not None else float("nan")) * 1e-3
        t["best_ms"] += r["calls"] * r.get("best_us", float("nan")) * 1e-3
    return out


def run(dry: bool, budget_s: float, repeats: int, json_path: Path | None) -> dict:
    cuda = torch.cuda.is_available() and not dry
    torch.manual_seed(0)
    todo = shapes("tiny" if dry else "pi05")
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "dtype": "bfloat16" if cuda else "float32", "layers": LAYERS if cuda else 1,
              "peak_bf16": cal.PEAK_BF16, "rows": []}  # fmt: skip
    if cuda:  # the context and cuBLAS's handle before the clock: not the first shape's share
        F.linear(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, s in enumerate(todo):
        deadline = time.perf_counter() + (budget_s - (time.perf_counter() - t0)) / (len(todo) - i)
        row = measure(s, cuda, repeats, deadline)
        result["rows"].append(row)
        lin = row["candidates"].get("linear", {})
        print(f"{s['region']:9s} {s['gemm']:8s} {s['m']:>5d}x{s['n']:<6d}x{s['k']:<6d} "
              f"est {row['estimate_us']:8.2f} us  linear {lin.get('us', float('nan')):8.2f} us "
              f"({100 * lin.get('of_peak', float('nan')):4.1f} %)  best {row.get('best', '-')} "
              f"{row.get('best_us', float('nan')):8.2f} us", flush=True)  # fmt: skip
        if cuda:
            torch.cuda.empty_cache()
        result["totals"] = totals(result["rows"])
        result["seconds"] = time.perf_counter() - t0
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(result, indent=1))
    return result


def report(result: dict) -> None:
    print(f"\nGEMMs of a pi05 action on {result['device']} ({result['dtype']}), ms an action")
    print(f"{'region':9s} {'estimate':>9s} {'linear':>8s} {'best':>8s}")
    for region, t in result.get("totals", {}).items():
        flag = "  LOSS: slower than the fitted rate" if t["linear_ms"] > t["estimate_ms"] else ""
        print(f"{region:9s} {t['estimate_ms']:9.3f} {t['linear_ms']:8.3f} "
              f"{t['best_ms']:8.3f}{flag}")  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, checks only")
    p.add_argument("--budget-s", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args.dry, args.budget_s, args.repeats, args.json)
    report(result)
    # the product's call must be right everywhere; on the CPU every candidate too (a GPU
    # may refuse a candidate: recorded, ranked out)
    bad = [f"{r['region']}/{r['gemm']}" for r in result["rows"]
           if not all(c.get("ok") for k, c in r["candidates"].items()
                      if args.dry or k == "linear")]  # fmt: skip
    if bad:
        print(f"FAIL: a candidate did not match the fp32 GEMM for {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
