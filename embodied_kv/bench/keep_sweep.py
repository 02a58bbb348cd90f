"""`bench keep --sweep`: KEEP's operating point against CacheBlend's (issue #38 item 4).

KEEP's recompute ratios (r_1 at layer 1 down to r_(L-1) at the last, linear between)
and CacheBlend's token share are swept in one run over the same stream, memory and
queries as `bench keep`, with full recomputation as the reference:

    keep@r1,rL        KEEP (static groups, multi-hop, layer-balanced loading) at r_1, r_(L-1)
    cacheblend@s      CacheBlend recomputing the share s of memory tokens from layer 1 on

Per point: TTFT, speed-up over full recomputation, the token-layers computed, two-hop
accuracy and same-answer-as-full. The frontier of a family is its points that no other
point of it beats on TTFT and same-answer at once; a KEEP point is dominated when a
CacheBlend point is at least as fast and at least as often gives full recomputation's
answer (and two-hop), better in one. `--quick` (16 requests) is a smoke of the sweep,
not a decision: same-answer over 16 requests has a standard error of ~0.1.
"""

from __future__ import annotations

from embodied_kv.kv.memory_methods import FullRecompute, Selective, keep
from embodied_kv.kv.selectors import CacheBlendSelector, KeepConfig

KEEP_POINTS = ((0.5, 0.2), (0.4, 0.1), (0.3, 0.1), (0.2, 0.05), (0.1, 0.0))  # (r_1, r_(L-1))
BLEND_SHARES = (0.05, 0.1, 0.15, 0.3)
FIELDS = ("ttft_ms", "speedup_vs_full", "compute_share", "two_hop", "same_answer", "one_hop")


def keep_name(r1: float, rl: float) -> str:
    return f"keep@{r1:g},{rl:g}"


def family(cache_slot: int, keep_points=KEEP_POINTS, shares=BLEND_SHARES) -> list:
    """Full recomputation (the reference, first), KEEP at each ratio pair, CacheBlend at
    each share: the methods `run_segments` runs instead of `memory_methods.methods`."""
    out = [FullRecompute()]
    out += [keep(KeepConfig(r1, rl), keep_name(r1, rl)) for r1, rl in keep_points]
    out += [Selective(f"cacheblend@{s:g}", False, lambda n, s=s: CacheBlendSelector(s))
            for s in shares]  # fmt: skip
    return out


def frontier(rows: list[dict]) -> dict:
    """Rows of one segment count -> per family its points, the frontier (names) and, per
    KEEP point, the CacheBlend points that dominate it."""
    points = {r["method"]: {k: r[k] for k in FIELDS} for r in rows}
    fams = {f: [m for m in points if m.startswith(f + "@")] for f in ("keep", "cacheblend")}

    def beats(a: dict, b: dict) -> bool:  # a at least as fast and as faithful, better in one
        ge = a["ttft_ms"] <= b["ttft_ms"] and a["same_answer"] >= b["same_answer"]
        return ge and (a["ttft_ms"] < b["ttft_ms"] or a["same_answer"] > b["same_answer"])

    front = {f: [m for m in ms if not any(beats(points[o], points[m]) for o in ms if o != m)]
             for f, ms in fams.items()}  # fmt: skip
    dominated = {
        k: [c for c in fams["cacheblend"] if beats(points[c], points[k])
            and points[c]["two_hop"] >= points[k]["two_hop"]]
        for k in fams["keep"]
    }  # fmt: skip
    return {"points": points, "frontier": front, "keep_dominated_by": dominated}


def summary_line(n: int, f: dict) -> str:
    beaten = {k: v for k, v in f["keep_dominated_by"].items() if v}
    if not beaten:
        head = f"no KEEP point is dominated by a CacheBlend point at {n} segments"
    else:
        head = f"CacheBlend dominates KEEP at {n} segments for " + "; ".join(
            f"{k} (by {', '.join(v)})" for k, v in beaten.items())
    fronts = "; ".join(f"{fam}: {', '.join(ms)}" for fam, ms in f["frontier"].items())
    return f"sweep: {head}; frontier (TTFT vs same-answer) {fronts}"
