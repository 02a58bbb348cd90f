"""The calibrated estimate's floor, and the measured one: how far kernel structure alone
can take the action.

The model's floor (`floor`): what bench/estimate_h200 would predict for any kernel structure
that keeps the GEMMs at the fitted rates. Every launch is free and every kernel that is not a
GEMM (attention, norms, RoPE, copies) costs nothing; the GEMMs cost what the fitted model
charges for their FLOPs and bytes without the per-kernel fixed term; the host term is the
measured one. No fusion, persistent kernel, graph or prefetch the CPU can build moves it:
what lowers it is a GEMM measured faster than the fitted rates (GEMM_COMPUTE_EFF at
GEMM_RAMP_ROWS for cuBLAS, TRITON_BW_EFF for the Triton kernels), fewer GEMM FLOPs (FP8,
fewer prefix rows) or a smaller host term, each of which only a GPU measures.

The measured floor (`measured_floor`): the vision and prefill GEMMs and attention at the
device time the H200's profiler gave them (2026-12-04; the fit overprices the prefill's
GEMMs, 285 us a layer against 254 measured, and underprices others), the expert's weights
read once per layer-step at the full HBM bandwidth, the measured host term; launches, norms,
RoPE and elementwise kernels free. What is left of 10 ms under it is what the expert's
attention (measured at its best beside it), every other kernel and every launch may take.

Issue 33 asks for an estimate of <= 10 ms at 2 cameras as its CPU-side evidence; both floors
say how much of that needs kernels faster than any a GPU has measured here.
"""

from __future__ import annotations

import json

from embodied_kv.bench import estimate_h200 as h2
from embodied_kv.bench.estimate import step_bucket
from embodied_kv.model.config import get_preset

GEMM_CLASSES = ("gemm", "triton_gemm")
# the measured floor's sources (H200, 2026-12-04): call 1's profiler tables (the fused
# path, 9fde0a2: every cuBLAS GEMM of vision and prefill in its top 20) and call 2's sweep
PROFILE = h2.H200_RESULTS / "latency.json"
SWEEP = h2.H200_RESULTS / "kernel_sweep.json"
DRY_ROWS = {"prefill": 40, "prefill3": 56, "vision": 32, "expert": 5}


def shapes(name: str) -> list[dict]:
    """[{region, gemm, m, n, k, calls (an action's), bias}] of a preset's action path."""
    c = get_preset(name)
    b, e, v = c.backbone, c.expert, c.vision
    dry = name != "pi05"
    prefix = h2.cal.MEASURED_PREFIX  # 2 and 3 cameras of 256 image tokens + the prompt
    rows = {
        "prefill": DRY_ROWS["prefill"] if dry else step_bucket(prefix[2]),
        "prefill3": DRY_ROWS["prefill3"] if dry else step_bucket(prefix[3]),
        "vision": DRY_ROWS["vision"] if dry else 2 * v.tokens,
        "expert": DRY_ROWS["expert"] if dry else c.action_horizon,
    }
    out = []

    def gemms(region, g, calls, bias):
        qkv = (g.heads + 2 * g.kv_heads) * g.head_dim
        for gemm, n, k in (("qkv", qkv, g.width), ("o", g.width, g.heads * g.head_dim),
                           ("gate_up", 2 * g.mlp, g.width), ("down", g.width, g.mlp)):  # fmt: skip
            out.append(dict(region=region, gemm=gemm, m=rows[region], n=n, k=k, calls=calls,
                            bias=bias))  # fmt: skip

    gemms("prefill", b, b.layers, False)
    gemms("prefill3", b, b.layers, False)
    for gemm, n, k in (("qkv", 3 * v.width, v.width), ("o", v.width, v.width),
                       ("fc1", v.mlp, v.width), ("fc2", v.width, v.mlp)):  # fmt: skip
        out.append(dict(region="vision", gemm=gemm, m=rows["vision"], n=n, k=k,
                        calls=v.layers, bias=True))  # fmt: skip
    gemms("expert", e, e.layers * c.denoise_steps, False)
    return out


def gemm_ms(kernels: list[dict], p: dict) -> float:
    """The GEMM kernels of a region at the fitted rates, their fixed costs left out."""
    p100 = h2.in_h100_terms(p)
    fixed = p["kernel_fixed_s"]
    return 1e3 * sum(
        k["n"] * (h2.kernel_s(k, p, p100) - fixed) for k in kernels if k["cls"] in GEMM_CLASSES
    )


def floor(censuses: dict, host: dict, p: dict | None = None) -> dict:
    """{"cameras/text tokens": {vision, prefill, denoise, host, total}} in ms: each region's
    GEMMs alone (`gemm_ms`), the least over the censuses (the layer-steps: {path: census})
    of each region, plus the measured host term ({cameras: ms})."""
    p = p or h2.params()
    by_path = [h2.regions(c) for c in censuses.values()]
    out = {}
    for cams in by_path[0]:
        r = {g: min(gemm_ms(b[cams][g], p) for b in by_path) for g in h2.REGIONS}
        r["host"] = host[int(cams.split("/")[0])]
        r["total"] = sum(r.values())
        out[cams] = r
    return out


def floor_rows(censuses: dict, hbm: float = h2.HBM_H200) -> list[dict]:
    """Per camera count: the floor's regions and total (the latest measured host term)."""
    rows = []
    for cams, r in floor(censuses, h2.host_ms(), h2.params(hbm)).items():
        rows.append(dict(cameras=int(cams.split("/")[0]), **{f"{g}_ms": v for g, v in r.items()}))
    return rows


def print_floor(rows: list[dict], rows_h100: list[dict]) -> None:
    print("\nthe model's floor (ms): GEMMs alone at the fitted rates, every launch and every")
    print("other kernel free, the measured host term; no kernel structure priced at these")
    print("rates goes under it")
    print("cams  vision  prefill  denoise  host  H200 total  H100 total")
    for r, r100 in zip(rows, rows_h100, strict=True):
        print(
            f"{r['cameras']:>4} {r['vision_ms']:>7.2f} {r['prefill_ms']:>8.2f} "
            f"{r['denoise_ms']:>8.2f} {r['host_ms']:>5.2f} {r['total_ms']:>11.2f} "
            f"{r100['total_ms']:>11.2f}"
        )


def is_gemm(name: str) -> bool:
    """A bf16 cuBLAS GEMM kernel by its profiler name (nvjet on sm_90; not sgemm: the fp32
    flow projections, a kernel of their own since)."""
    return name.startswith("nvjet") or ("gemm" in name and "sgemm" not in name)


def is_attention(name: str) -> bool:
    """The prefill's tile kernel and SigLIP's SDPA (cuDNN's flash attention)."""
    return name.startswith("_prefill_tile") or "sdpa" in name or "flash" in name


def expert_attention_us(sweep: dict) -> float:
    """The expert attention's least measured time a call (the chain's or the best candidate's,
    18 layers in one graph)."""
    row = sweep["kernels"]["expert_attention"]
    return min(row["chain_us"], row.get("best", {}).get("us", float("inf")))


def expert_layer_steps() -> int:
    """An action's expert layer-steps at pi05: its layers x the Euler steps (180)."""
    c = get_preset("pi05")
    return c.expert.layers * c.denoise_steps


def expert_weights_ms(hbm: float = h2.HBM_H200) -> float:
    """The action expert's weights read once a layer-step at the full HBM bandwidth (no
    measured kernel does better: the H200's chain took ~11.4 ms for its whole denoise)."""
    rows = [s for s in shapes("pi05") if s["region"] == "expert"]
    return 1e3 * sum(s["calls"] * 2.0 * s["n"] * s["k"] for s in rows) / hbm


def measured_floor(profile: dict | None = None, sweep: dict | None = None) -> list[dict]:
    """Per camera count, in ms: the vision and prefill GEMMs and attention at the device time
    they took on the H200 (its profile: every launch, gap and other kernel free), the
    expert's weights read once at the full HBM bandwidth, the measured host term; `total`
    their sum (what is left under 10 ms is for every norm, RoPE and elementwise kernel, the
    launches and the expert's attention, measured at `expert_attention_ms` at its best)."""
    profile = profile or json.loads(PROFILE.read_text())
    sweep = sweep or json.loads(SWEEP.read_text())
    host = h2.host_ms()
    weights_ms = expert_weights_ms()
    attention_ms = 1e-3 * expert_layer_steps() * expert_attention_us(sweep)
    rows = []
    for row in profile["rows"]:
        k = row["kernels"]
        per_cycle = {r["name"]: r["self_us"] / k["cycles"] for r in k["rows"]}
        cams = row["cameras"]
        r = dict(cameras=cams,
                 gemm_ms=1e-3 * sum(us for n, us in per_cycle.items() if is_gemm(n)),
                 attention_ms=1e-3 * sum(us for n, us in per_cycle.items() if is_attention(n)),
                 expert_weights_ms=weights_ms, host_ms=host[cams],
                 expert_attention_ms=attention_ms)  # fmt: skip
        r["total_ms"] = r["gemm_ms"] + r["attention_ms"] + r["expert_weights_ms"] + r["host_ms"]
        rows.append(r)
    return rows


def print_measured_floor(rows: list[dict]) -> None:
    print("\nthe measured floor (ms; H200 2026-12-04): vision and prefill GEMMs and attention at")
    print("their profiled device time, the expert's weights once at the full HBM bandwidth,")
    print("the measured host term; launches, norms, RoPE, elementwise kernels free")
    print("cams  GEMMs  attention  expert weights  host  total  (expert attention, measured)")
    for r in rows:
        print(
            f"{r['cameras']:>4} {r['gemm_ms']:>6.2f} {r['attention_ms']:>10.2f} "
            f"{r['expert_weights_ms']:>15.2f} {r['host_ms']:>5.2f} {r['total_ms']:>6.2f}  "
            f"({r['expert_attention_ms']:.2f})"
        )
