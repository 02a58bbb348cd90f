"""The expert layer-step's kernels at pi05 shapes over their tile configurations, beside the
ops of the chain each one replaces: which configuration, if any, wins on this GPU.

    python -m embodied_kv.bench.kernel_sweep --json PATH [--budget-s 200] [--dry]

Why: the 2026-12-04 H200 profile (bench/results/2026-12-04-nvidia-h200/) measured the fused
layer-step slower than the unfused chain (29.97 against 25.23 ms a pi05 action) with
norm_qkv_rope 21 us, norm_gate_up 23 us, linear_gated_residual 12 us and the expert
attention 39 us a call, against weight-read floors of 1-4 us: the configurations were
reasoned, never timed. Each candidate here is timed as the denoise runs it: 18 layers'
weights (and prefix K/V) rotated inside one captured CUDA graph, so the weights come from
HBM, not L2; median of replays, per call. Each is first checked against an fp32 run of the
same inputs (poisoned output, relative error; a candidate over 2x the chain's bf16 error is
marked wrong and not ranked). The chain is the unfused layer-step's ops as CUDA runs them
(the norm, RoPE and GELU-gate Triton kernels, cuBLAS GEMMs over the fused weights, torch's
addcmul); for the attention, which both layer-steps share, torch's reference ops. Rows
print as they finish and the JSON is rewritten after each, so a run killed at its budget
keeps what it measured; `--budget-s` stops adding candidates past that many seconds.

`--dry`: tiny shapes on the CPU, one candidate per kernel under TRITON_INTERPRET=1, checks
only (the CI test), so the device call cannot fail on what the CPU could have shown.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from embodied_kv.bench.kernel_sweep_candidates import (
    EPS,
    attn_candidates,
    fusion_candidates,
    gate_candidates,
    patched,
    qk_views,
    qkv_candidates,
    res_candidates,
    rope_attn_candidates,
    step_candidates,
)
from embodied_kv.kernels import expert_attention as attn_k
from embodied_kv.kernels import gemm_residual as res_k
from embodied_kv.kernels import norm_gate_up as gate_k
from embodied_kv.kernels import norm_qkv_rope as qkv_k
from embodied_kv.kernels.gelu_gate import gelu_gate, gelu_gate_ref
from embodied_kv.kernels.rms_norm import rms_norm, rms_norm_ref
from embodied_kv.kernels.rope import rope, rope_ref
from embodied_kv.model.expert_step import WorkspaceCache
from embodied_kv.model.layers import Rope

__all__ = ["PI05", "TINY", "kernels", "main", "patched", "run"]

LAYERS = 18  # pi05's expert depth: one weight set per layer in the graph
# the attention at the prefix of 2 cameras (663 rows, bucket 704) and of 3 (921, bucket 960)
PI05 = {"n": 50, "w": 1024, "hq": 8, "hkv": 1, "d": 256, "f": 4096, "prefix": 663, "bucket": 704,
        "prefix3": 921, "bucket3": 960}  # fmt: skip
TINY = {"n": 5, "w": 64, "hq": 2, "hkv": 1, "d": 16, "f": 128, "prefix": 21, "bucket": 32,
        "prefix3": 40, "bucket3": 48}  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def time_graph(calls, repeats: int) -> float:
    """us per call: `calls` (one closure per layer) captured in one graph, replayed."""
    for c in calls:  # compile, allocate, warm
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def layer_inputs(s: dict, dtype, device, layers: int) -> list[dict]:
    n, w, hq, hkv, d, f = (s[k] for k in ("n", "w", "hq", "hkv", "d", "f"))
    heads = hq + 2 * hkv
    rope_tables = Rope(d, n, 10000.0).to(device)  # the model's layout: [c, c], [-s, s]
    rope_tables.reset_tables()
    cos, sin = rope_tables.at(torch.arange(n, device=device))
    biases = {}
    for tag in ("", "3"):
        biases[tag] = torch.zeros(s["bucket" + tag] + n, device=device)
        biases[tag][s["prefix" + tag] : s["bucket" + tag]] = float("-inf")
    out = []
    for _ in range(layers):
        out.append({
            "h": rand(n, w, dtype=dtype, device=device),
            "scale1": 1 + 0.1 * torch.randn(w, device=device),
            "shift": 0.1 * torch.randn(w, device=device),
            "w_qkv": rand(heads * d, w, dtype=dtype, device=device, scale=w ** -0.5),
            "w_gu": rand(2 * f, w, dtype=dtype, device=device, scale=w ** -0.5),
            "cos": cos,
            "sin": sin,
            "x_o": rand(n, hq * d, dtype=dtype, device=device),
            "w_o": rand(w, hq * d, dtype=dtype, device=device, scale=(hq * d) ** -0.5),
            "x_d": rand(n, f, dtype=dtype, device=device),
            "w_d": rand(w, f, dtype=dtype, device=device, scale=f ** -0.5),
            "gate": rand(w, dtype=dtype, device=device, scale=0.5),
            "q": rand(n, hq, d, dtype=dtype, device=device),
            "kp": rand(s["bucket"], hkv, d, dtype=dtype, device=device),
            "vp": rand(s["bucket"], hkv, d, dtype=dtype, device=device),
            "kp3": rand(s["bucket3"], hkv, d, dtype=dtype, device=device),
            "vp3": rand(s["bucket3"], hkv, d, dtype=dtype, device=device),
            "ks": rand(n, hkv, d, dtype=dtype, device=device),
            "vs": rand(n, hkv, d, dtype=dtype, device=device),
            "bias": biases[""], "bias3": biases["3"],
            "y": rand(n, w, dtype=dtype, device=device),  # a GEMM output joining the stream
            "qkv": rand(n, heads * d, dtype=dtype, device=device),  # the fused q/k/v output
        })  # fmt: skip
    return out


# ---- the chains: what the unfused layer-step runs on CUDA, op for op (the norm, RoPE and
# GELU-gate dispatchers: their Triton kernels there; cuBLAS GEMMs over the fused weights),
# and the same ops' torch references on fp32 inputs (the error's reference)


def qkv_chain(L, s, ref=False):
    n, d, hq, hkv = s["n"], s["d"], s["hq"], s["hkv"]
    norm, rot = (rms_norm_ref, rope_ref) if ref else (rms_norm, rope)
    xn = norm(L["h"], L["scale1"], EPS, L["shift"])
    q, k, v = F.linear(xn, L["w_qkv"]).view(n, -1, d).split([hq, hkv, hkv], dim=1)
    return torch.cat([rot(q, L["cos"], L["sin"]), rot(k, L["cos"], L["sin"]), v], 1)


def gate_chain(L, s, ref=False):
    norm, act = (rms_norm_ref, gelu_gate_ref) if ref else (rms_norm, gelu_gate)
    xn = norm(L["h"], L["scale1"], EPS, L["shift"])
    g, u = F.linear(xn, L["w_gu"]).split(s["f"], dim=-1)
    return act(g, u)


def res_chain(L, k):
    x, w = (L["x_o"], L["w_o"]) if k == "o" else (L["x_d"], L["w_d"])
    return torch.addcmul(L["h"], F.linear(x, w), L["gate"])


# the five launches' workspaces per layer's inputs (by its h), allocated once, outside the
# timed graph, as the model keeps them (model/expert_step.py WorkspaceCache)
_FIVE_WORK: dict[tuple, tuple] = {}


def step_five(L, s, ref=False):
    """The fused layer-step as five launches (model/expert_step.py layer_step_fused), or in
    fp32 the five ops' torch references: the baseline of the persistent launch."""
    n, d, hq, hkv = s["n"], s["d"], s["hq"], s["hkv"]
    h = L["h"]
    sizes = [hq * d, hkv * d, hkv * d]
    q, k, v = (qkv_k.norm_qkv_rope_ref if ref else qkv_k.norm_qkv_rope_kernel)(
        h, L["scale1"], L["shift"], EPS, L["w_qkv"], sizes, L["cos"], L["sin"])  # fmt: skip
    if ref:
        o = attn_k.expert_attention_ref(q, L["kp"], L["vp"], k, v, d**-0.5, L["bias"])
        h1 = res_k.linear_gated_residual_ref(h, o.reshape(n, -1), L["w_o"], L["gate"])
        act = gate_k.norm_gate_up_ref(h1, L["scale1"], L["shift"], EPS, L["w_gu"], s["f"])
        return res_k.linear_gated_residual_ref(h1, act, L["w_d"], L["gate"])
    key = (id(h), tuple(h.shape), h.dtype, str(h.device))
    if key not in _FIVE_WORK:
        _FIVE_WORK[key] = (WorkspaceCache(), attn_k.expert_workspace(
            n, hq, hkv, d, L["kp"].shape[0], h.dtype, h.device))  # fmt: skip
    works, att = _FIVE_WORK[key]
    o = attn_k.expert_attention_kernel(q, L["kp"], L["vp"], k, v, d**-0.5, L["bias"], att)
    h1 = res_k.linear_gated_residual_kernel(h, o.reshape(n, -1), L["w_o"], L["gate"],
                                            works.get(h, L["w_o"]))  # fmt: skip
    act = gate_k.norm_gate_up_kernel(h1, L["scale1"], L["shift"], EPS, L["w_gu"], s["f"])
    return res_k.linear_gated_residual_kernel(h1, act, L["w_d"], L["gate"],
                                              works.get(h1, L["w_d"]))  # fmt: skip


def attn_chain(L, s, tag=""):
    """The torch reference: the chain's attention is the same kernel as the fused path's.
    `tag` "3": the 3-camera prefix."""
    return attn_k.expert_attention_ref(L["q"], L["kp" + tag], L["vp" + tag], L["ks"], L["vs"],
                                       s["d"] ** -0.5, L["bias" + tag])  # fmt: skip


def gated_chain(L, s, ref=False):
    """addcmul, then the adaRMS norm (the chain before kernels/gated_rms_norm.py): [s, xn]."""
    norm = rms_norm_ref if ref else rms_norm
    h = torch.addcmul(L["h"], L["y"], L["gate"])
    return torch.cat([h, norm(h, L["scale1"], EPS, L["shift"])], 1)


def rope_chain(L, s, ref=False):
    """RoPE on q, then on k (the chain before kernels/rope.py rope_pair)."""
    rot = rope_ref if ref else rope
    q, k = qk_views(L, s)
    return torch.cat([rot(q, L["cos"], L["sin"]), rot(k, L["cos"], L["sin"])], 1)


def rope_attn_chain(L, s, ref=False):
    """RoPE on q and the suffix k, then the attention: the chain's step before the attention
    rotated them as it loads them (kernels/expert_attention.py `rope=`)."""
    rot = rope_ref if ref else rope
    q, k = (rot(x, L["cos"], L["sin"]) for x in qk_views(L, s))
    return attn_k.expert_attention_ref(q, L["kp"], L["vp"], k, L["vs"], s["d"] ** -0.5,
                                       L["bias"])  # fmt: skip


def fp32(L):
    return {k: (v.float() if v.is_floating_point() else v) for k, v in L.items()}


def kernels(s):
    """(kernel, the chain, fp32 reference, output of a candidate -> comparable, candidates)."""
    n = s["n"]
    flat = lambda o: o.reshape(n, -1)  # noqa: E731
    return [
        ("expert_attention", lambda L: flat(attn_chain(L, s)),
         lambda L: flat(attn_chain(fp32(L), s)), flat, lambda dry: attn_candidates(s, dry)),
        ("norm_qkv_rope", lambda L: flat(qkv_chain(L, s)),
         lambda L: flat(qkv_chain(fp32(L), s, True)), flat, lambda dry: qkv_candidates(s, dry)),
        ("norm_gate_up", lambda L: gate_chain(L, s), lambda L: gate_chain(fp32(L), s, True),
         lambda o: o, lambda dry: gate_candidates(s, dry)),
        ("gated_residual_o", lambda L: res_chain(L, "o"), lambda L: res_chain(fp32(L), "o"),
         lambda o: o, lambda dry: res_candidates(s, dry, "o")),
        ("gated_residual_down", lambda L: res_chain(L, "d"), lambda L: res_chain(fp32(L), "d"),
         lambda o: o, lambda dry: res_candidates(s, dry, "d")),
        ("chain_gated_rms_norm", lambda L: gated_chain(L, s),
         lambda L: gated_chain(fp32(L), s, True), lambda o: o,
         lambda dry: fusion_candidates(s, "gated")),
        ("chain_rope_qk", lambda L: flat(rope_chain(L, s)),
         lambda L: flat(rope_chain(fp32(L), s, True)), flat,
         lambda dry: fusion_candidates(s, "rope")),
        ("chain_rope_attention", lambda L: flat(rope_attn_chain(L, s)),
         lambda L: flat(rope_attn_chain(fp32(L), s, True)), flat,
         lambda dry: rope_attn_candidates(s)),
        ("layer_step", lambda L: step_five(L, s), lambda L: step_five(fp32(L), s, True),
         lambda o: o, lambda dry: step_candidates(s)),
        ("expert_attention_3cam", lambda L: flat(attn_chain(L, s, "3")),
         lambda L: flat(attn_chain(fp32(L), s, "3")), flat,
         lambda dry: attn_candidates(s, dry, "3")),
    ]  # fmt: skip


def run(dry: bool, budget_s: float, repeats: int, json_path: Path | None) -> dict:
    cuda = torch.cuda.is_available() and not dry
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    s = TINY if dry else PI05
    torch.manual_seed(0)
    layers = layer_inputs(s, dtype, device, LAYERS if cuda else 1)
    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
              "shapes": s, "layers": len(layers), "kernels": {}}  # fmt: skip

    def save():
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(result, indent=1))

    todo = kernels(s)
    for i, (name, chain, ref_fn, view, candidates) in enumerate(todo):
        # each kernel its share of what is left of the budget
        deadline = time.perf_counter() + (budget_s - (time.perf_counter() - t0)) / (len(todo) - i)
        ref = ref_fn(layers[0])
        chain_err = rel_err(chain(layers[0]), ref)
        row = {"chain_err": chain_err, "candidates": []}
        result["kernels"][name] = row
        if cuda:
            try:
                row["chain_us"] = time_graph([lambda L=L, c=chain: c(L) for L in layers], repeats)
            except Exception as e:  # noqa: BLE001 - recorded; the candidates still run
                row["chain_us"], row["chain_error"] = float("nan"), repr(e)[:300]
            print(f"{name:20s} chain {row['chain_us']:8.2f} us  err {chain_err:.2e}",
                  flush=True)
        for label, make in candidates(dry):
            if time.perf_counter() > deadline:
                row["stopped"] = "its share of the budget reached"
                break
            cand = {"config": label}
            try:
                out, call = make(layers[0])
                if out is not None:
                    out.fill_(float("nan"))
                got = call()
                cand["err"] = rel_err(view(got if out is None else out), ref)
                cand["ok"] = cand["err"] <= max(2 * chain_err, 1e-5)
                if cuda and cand["ok"]:
                    made = [make(L) for L in layers]
                    cand["us"] = time_graph([c for _, c in made], repeats)
            except Exception as e:  # noqa: BLE001 - a config may not compile (or torch may not
                # support a shape): record why
                cand["error"] = repr(e)[:300]
            row["candidates"].append(cand)
            print(f"{name:20s} {label:58s} {cand.get('us', float('nan')):8.2f} us  "
                  f"err {cand.get('err', float('nan')):.2e} {cand.get('error', '')[:80]}",
                  flush=True)  # fmt: skip
            save()
        timed = [c for c in row["candidates"] if "us" in c and c["ok"]]
        if timed:
            best = min(timed, key=lambda c: c["us"])
            row["best"] = best
            if cuda:
                row["best_over_chain"] = row["chain_us"] / best["us"]
        save()
    result["seconds"] = time.perf_counter() - t0
    save()
    return result


def report(result: dict) -> None:
    print(f"\nkernel sweep on {result['device']} ({result['dtype']}), {result['layers']} layers")
    print(f"{'kernel':20s} {'chain_us':>9s} {'best_us':>8s} {'x':>6s}  best config")
    for name, row in result["kernels"].items():
        best = row.get("best", {})
        ratio = row.get("best_over_chain")
        flag = "" if ratio is None or ratio >= 1 else "  LOSS: the chain is faster"
        print(f"{name:20s} {row.get('chain_us', float('nan')):9.2f} "
              f"{best.get('us', float('nan')):8.2f} {ratio or float('nan'):6.2f}  "
              f"{best.get('config', '-')}{flag}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU, checks only")
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--dry runs the kernels under TRITON_INTERPRET=1 (set it)")
    result = run(args.dry, args.budget_s, args.repeats, args.json)
    report(result)
    bad = [n for n, r in result["kernels"].items() if not any(c.get("ok") for c in r["candidates"])]
    if bad:
        print(f"FAIL: no candidate matched the reference for {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
