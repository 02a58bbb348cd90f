"""`embodied-kv bench estimate`: the pi05 action latency on an H100, estimated from the
kernels the real code launches and the bytes they move, next to the arithmetic limit.

No GPU run exists; this is an estimate, reproducible on any CPU:

1. Build pi05 at its real widths (2048 / 1024 / 1152, vocab 257,152) at depth 1 and 2
   (SigLIP too), bf16, on the CPU.
2. Run one action's path with a dispatch-level census (bench/kernel_census.py): the
   cameras through the vision tower, the prefix embedding, the prefill step (padded as
   the step graph pads it) with the logits of its last row bucket, and the 10-step Euler
   loop of the action expert as the denoise graph runs it (masked prefix rows).
3. Per layer = depth 2 - depth 1; the totals are scaled to 18 (27 vision) layers.
4. Each kernel costs max(FLOPs / (eff_c x peak), bytes / (eff_b x bandwidth)), plus a
   gap per kernel inside a CUDA graph, or the eager launch cost where it is the larger
   (regions not captured). The limit is the same sum at 100 % of peak and no gaps.
"""

from __future__ import annotations

import argparse
import gc
import sys
from contextlib import contextmanager

import torch

from embodied_kv.bench import harness, limit
from embodied_kv.bench.estimate_costs import (
    action_in_cost,
    add_layer_norm_cost,
    add_rms_norm_cost,
    euler_out_cost,
    gated_rms_norm_cost,
    gelu_gate_cost,
    linear_gated_residual_cost,
    norm_cost,
    norm_gate_up_cost,
    norm_qkv_rope_cost,
    rope_cost,
    rope_pair_cost,
    rope_store_cost,
)
from embodied_kv.bench.kernel_census import Census, Roofline, Tally
from embodied_kv.bench.report import print_table
from embodied_kv.engine.graphs import STEP_BUCKETS
from embodied_kv.kernels import expert_attention as attention_kernels
from embodied_kv.kernels import prefill_tile
from embodied_kv.kernels.expert_attention import chunk_blocks, split_count
from embodied_kv.kernels.packed_attention import KEY_BLOCK, SPLITK_MAX_TOKENS
from embodied_kv.kernels.prefill_tile import tile_config
from embodied_kv.model.config import get_preset
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import DENOISE_BUCKETS, StepInput, build_model
from embodied_kv.storage.step import Segment, commit_step, plan_step

# H100 SXM: bf16 dense and HBM3 (the arithmetic limit, bench/limit.py, uses these two
# numbers); fp32 GEMMs without TF32 run on the 67 TFLOP/s fp32 units
H100 = dict(flops_per_s=limit.PEAK_FLOPS, bytes_per_s=limit.HBM_BYTES_PER_S, fp32_flops_per_s=67e12)
COMPUTE_EFF = 0.70  # large cuBLAS bf16 GEMMs on H100 SXM reach ~650-750 TFLOP/s
MEMORY_EFF = 0.80  # streaming kernels reach ~2.7 TB/s of 3.35
GRAPH_GAP_S = 1.5e-6  # per kernel node in a replayed graph (launch + tail), H100
EAGER_LAUNCH_S = 6e-6  # per torch op launched from Python (CPU-bound when kernels are short)
# One step of an attention kernel's key loop (a 64-row query tile x 16 keys: loads, two MMAs,
# the online softmax), measured on the H100 (2026-11-22): the unsplit expert attention took
# 83 us for its programs' 52 steps (1.6 us), the prefill tile 43.5 us for 42 (1.0 us)
STEP_LATENCY_S = 1.3e-6
TEXT_TOKENS = limit.TEXT_TOKENS  # the published limit's prompt length
REGIONS = ("vision", "embed", "prefill", "logits", "denoise")
CAPTURED = {"vision", "prefill", "logits", "denoise"}  # engine/graphs.py: vision, step, denoise


def step_bucket(rows: int) -> int:
    """The packed step's graph bucket for `rows` tokens (engine/graphs.py STEP_BUCKETS)."""
    return next(b for b in STEP_BUCKETS if b >= rows)


def attention_cost(q, k_cache, slot, kv_len) -> tuple | list:
    """The Triton packed-attention kernel (the prefill tile at a prefill's size): QK^T and
    PV over each token's rows; q and out once; K/V of a slot once from HBM (a slot's layer
    is < 1 MiB at pi05: tile re-reads hit the 50 MB L2); its longest program walks the
    longest token's rows BLOCK_N at a time. A tile split over keys (prefill_tile.KEY_SPLITS,
    past SPLITK_MAX_TOKENS tokens) walks 1 / splits of them, writes fp32 partials and
    launches decode_splitk's reduce over them."""
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    flops = 4.0 * float(kv_len.sum()) * hq * d
    rows = sum(int(kv_len[slot == s].max()) for s in slot.unique())
    kv_bytes = 2 * rows * hkv * d * k_cache.element_size()
    splits = prefill_tile.KEY_SPLITS if n > SPLITK_MAX_TOKENS else 1
    blocks = -(-int(kv_len.max()) // tile_config(q.dtype, hq // hkv, splits).block_n)
    q_bytes = 2.0 * q.numel() * q.element_size()
    if splits == 1:
        return flops, q_bytes + kv_bytes, blocks
    partials = 4.0 * n * hq * splits * (d + 2)
    return [(flops, q_bytes / 2 + kv_bytes + partials, -(-blocks // splits)),
            (3.0 * n * hq * splits * d, partials + q_bytes / 2, splits)]  # fmt: skip


def expert_attention_cost(
    q, kp, vp, ks, vs, scale, bias, work=None, rope=None
) -> list[tuple[float, float, int]]:
    """The expert attention as CUDA runs it (kernels/expert_attention.py): QK^T and PV over
    prefix + suffix rows for every query; q once, the prefix and suffix K/V once, fp32
    partials written and read back (L2-resident, counted), the reduce's FLOPs, out written.
    Two kernels (the partials, then the reduce) when REDUCE is "launch"; one otherwise (each
    tile's last split reduces, or the persistent queue's reduce items do: the same work, its
    counters besides, and the loop steps of both phases in one launch). With `rope` the
    partials rotate q and the suffix k as they load them: the two tables read, 3 FLOPs an
    element."""
    h_len, hq, d = q.shape
    rows = kp.shape[0] + ks.shape[0]
    kv = 2 * rows * kp.shape[1] * d * kp.element_size()
    block_n = tile_config(q.dtype, hq // kp.shape[1]).block_n
    splits = split_count(kp.shape[0], block_n)
    partials = 4.0 * h_len * hq * splits * (d + 2)  # fp32 acc, max and sum per split
    q_bytes = q.numel() * q.element_size()
    steps = max(chunk_blocks(kp.shape[0], block_n, splits), -(-h_len // block_n))  # or suffix
    counters = 8.0 * -(-h_len // tile_config(q.dtype, hq // kp.shape[1]).block_m) * kp.shape[1]
    flops = 4.0 * h_len * hq * d * rows
    reduce_flops = 3.0 * h_len * hq * splits * d
    if rope is not None:
        flops += 3.0 * (q.numel() + ks.numel())
        q_bytes += 2 * rope[0].numel() * 4
    reduce = attention_kernels.REDUCE
    if reduce != "launch":
        moved = 2 * q_bytes + kv + bias.numel() * 4 + 2 * partials + counters
        return [(flops + reduce_flops, moved, steps + splits if reduce == "queue" else steps)]
    return [(flops, q_bytes + kv + bias.numel() * 4 + partials, steps),
            (reduce_flops, partials + q_bytes, splits)]  # fmt: skip


def layer_step_persistent_cost(layer, h, s, work=None, kernels=False, prefetch=True):
    """The five kernels' work as one persistent launch (kernels/expert_layer_step.py): their
    FLOPs and bytes summed (the reference path inside runs them, recorded as part of this)."""
    attn, mlp = layer.self_attn, layer.mlp
    d, hq, hkv = attn.head_dim, attn.heads, attn.kv_heads
    n = h.shape[0]
    q = h.new_empty(n, hq, d)
    kv = h.new_empty(n, hkv, d)
    costs = [
        norm_qkv_rope_cost(h, None, None, 0.0, attn.fusion.weight, [hq * d, hkv * d, hkv * d],
                           *s.cos_sin),
        *expert_attention_cost(q, s.kp, s.vp, kv, kv, s.scale, s.bias),
        linear_gated_residual_cost(h, q.view(n, -1), attn.o_proj.weight, s.gate[0]),
        norm_gate_up_cost(h, None, None, 0.0, mlp.fusion.weight, mlp.fusion.sizes[0]),
        linear_gated_residual_cost(h, h.new_empty(n, mlp.fusion.sizes[0]),
                                   mlp.down_proj.weight, s.gate[1]),
    ]  # fmt: skip
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


def layers_step_persistent_cost(layers, h, inputs, work=None, kernels=False, prefetch=True):
    """Every layer of an Euler step as one persistent launch: their layer-steps' work."""
    costs = [layer_step_persistent_cost(x, h, s) for x, s in zip(layers, inputs, strict=True)]
    return sum(c[0] for c in costs), sum(c[1] for c in costs)


@contextmanager
def euler_step_as_on_cuda(expert_module):
    """The expert's one launch an Euler step runs here as its layers' steps one by one (its
    kernel needs CUDA or the interpreter), so that the census records it as one kernel."""
    real = expert_module.layers_step_persistent

    def layer_by_layer(layers, h, inputs, work, kernels=False, prefetch=True):
        for layer, s in zip(layers, inputs, strict=True):
            h = expert_module.layer_step_persistent(layer, h, s, work)
        return h

    expert_module.layers_step_persistent = layer_by_layer
    try:
        yield
    finally:
        expert_module.layers_step_persistent = real


@contextmanager
def as_one_kernel(census: Census, module, name: str, cost):
    """`module.name` recorded as the single kernel it is on CUDA, priced by `cost(*args)`."""
    real = getattr(module, name)

    def counted(*args, **kwargs):
        with census.single_kernel(lambda: cost(*args, **kwargs)):
            return real(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, real)


@contextmanager
def cuda_kernels(census: Census):
    """What runs as one Triton kernel on CUDA but as its torch reference here: the
    backbone's packed attention, its RoPE with the K/V store and its residual adds with the
    RMSNorm after each, the expert's attention, every RMSNorm (plain and adaptive), RoPE
    rotation and GELU-gate product, the vision tower's add + LayerNorm
    (model/vision_fast.py), and the expert's fused layer-step
    (model/expert_step.py), taken where the fusions are in use as CUDA takes it."""
    import embodied_kv.kernels.add_layer_norm as residual_norm
    import embodied_kv.model.backbone as backbone
    import embodied_kv.model.expert as expert
    import embodied_kv.model.expert_step as step
    import embodied_kv.model.layers as layers

    def attention(q, k_cache, v_cache, slot, kv_len, *rest, **kwargs):
        return attention_cost(q, k_cache, slot, kv_len)

    with (
        as_one_kernel(census, backbone, "packed_attention", attention),
        as_one_kernel(census, layers, "rms_norm", norm_cost),
        as_one_kernel(census, layers, "rope_rotate", rope_cost),
        as_one_kernel(census, layers, "rope_pair", rope_pair_cost),
        as_one_kernel(census, step, "gated_rms_norm", gated_rms_norm_cost),
        as_one_kernel(census, backbone, "rope_store", rope_store_cost),
        as_one_kernel(census, backbone, "add_rms_norm", add_rms_norm_cost),
        as_one_kernel(census, expert, "action_in", action_in_cost),
        as_one_kernel(census, expert, "euler_out", euler_out_cost),
        as_one_kernel(census, step, "expert_attention", expert_attention_cost),
        as_one_kernel(census, layers, "gelu_gate", gelu_gate_cost),
        as_one_kernel(census, step, "norm_qkv_rope", norm_qkv_rope_cost),
        as_one_kernel(census, step, "norm_gate_up", norm_gate_up_cost),
        as_one_kernel(census, step, "linear_gated_residual", linear_gated_residual_cost),
        as_one_kernel(census, expert, "layer_step_persistent", layer_step_persistent_cost),
        euler_step_as_on_cuda(expert),  # then counted as one kernel:
        as_one_kernel(census, expert, "layers_step_persistent", layers_step_persistent_cost),
        as_one_kernel(census, residual_norm, "add_layer_norm", add_layer_norm_cost),
        fused_as_on_cuda(expert),
    ):
        yield


@contextmanager
def fused_as_on_cuda(expert_module):
    """The expert takes its five-kernel layer-step where CUDA would: wherever the q/k/v and
    gate/up fusions are in use (model/fused.py), whatever the device."""
    from embodied_kv.model.expert_step import fusions_usable

    real = expert_module.fused_ready
    expert_module.fused_ready = lambda layer, h: fusions_usable(layer)
    try:
        yield
    finally:
        expert_module.fused_ready = real


def action_census(model, cameras: int, text_tokens: int, graph_pad: bool) -> dict[str, Tally]:
    """One action chunk's kernels by region: prefix of `cameras` images + text, prefill
    (padded to the step graph's bucket if `graph_pad`, else to ROW_BUCKET rows only),
    10 Euler steps."""
    c = model.cfg
    gpu = Roofline(
        **H100, compute_eff=COMPUTE_EFF, memory_eff=MEMORY_EFF, step_latency_s=STEP_LATENCY_S
    )
    census = Census(gpu)
    images = synthetic_observation(c, 0).images[:cameras]
    ids = torch.arange(text_tokens) % 200 + 32
    n = cameras * c.vision.tokens + text_tokens
    pad = step_bucket(n) if graph_pad else 0
    rows = next(b for b in DENOISE_BUCKETS if b >= n)
    arena = model.new_arena(1, max(rows, -(-max(n, pad) // KEY_BLOCK) * KEY_BLOCK))
    slot = arena.allocate()
    with census, torch.no_grad(), cuda_kernels(census):
        with census.region("vision"):
            img = model.vision(images).reshape(-1, c.backbone.width).to(model.dtype)
        with census.region("embed"):
            prefix = torch.cat([img, model.backbone.embed(ids)])
        plan = plan_step(arena, [Segment(slot, n, causal=False)], pad)  # host work
        with census.region("embed"):
            x = model.embed_inputs([StepInput(slot, embeds=prefix, causal=False)], plan.n_padded)
        with census.region("prefill"):
            hidden = model.backbone(x, plan, arena)
        commit_step(arena, plan)
        with census.region("logits"):
            model.backbone.logits(hidden, plan.last_index)
        noise, plen = model.make_noise(0), torch.tensor(n)
        with census.region("denoise"):
            model.expert.sample(arena, slot, plen, noise, rows)
    return census.tallies


def scaled(by_depth: dict[int, dict[str, Tally]], layers: int, vision_layers: int):
    """Per region: fixed + per-layer x depth, from the censuses at depth 1 and 2."""
    out = {}
    for r in REGIONS:
        one, two = by_depth[1][r], by_depth[2][r]
        per_layer = two - one
        out[r] = (one - per_layer) + per_layer * (vision_layers if r == "vision" else layers)
    return out


def region_ms(t: Tally, captured: bool) -> float:
    if captured:
        return 1e3 * (t.busy_s + t.kernels * GRAPH_GAP_S)
    return 1e3 * max(t.busy_s + t.kernels * GRAPH_GAP_S, t.kernels * EAGER_LAUNCH_S)


def estimate(cameras_list=(2, 3), text_tokens: int = TEXT_TOKENS) -> dict:
    full = get_preset("pi05")
    censuses: dict = {}
    for depth in (1, 2):
        model = build_model(
            get_preset("pi05", layers=depth, vision_layers=depth), "cpu", dtype=torch.bfloat16
        )
        fuse_projections(model)  # as build_model does on CUDA: q/k/v and gate/up one GEMM each
        for cams in cameras_list:
            for graph_pad in (True, False):
                censuses.setdefault((cams, graph_pad), {})[depth] = action_census(
                    model, cams, text_tokens, graph_pad
                )
        del model
        gc.collect()
    rows = []
    for cams in cameras_list:
        t = scaled(censuses[(cams, True)], full.backbone.layers, full.vision.layers)
        t16 = scaled(censuses[(cams, False)], full.backbone.layers, full.vision.layers)
        limit_parts = dict(t16, logits=Tally())  # the limit needs no logits, no padding
        today = sum(region_ms(t[r], r in CAPTURED) for r in REGIONS)
        all_graphs = sum(region_ms(t[r], True) for r in REGIONS)
        row_bucket = sum(region_ms(t16[r], True) for r in REGIONS)
        rows.append(
            {
                "cameras": cams,
                "prefix_tokens": cams * full.vision.tokens + text_tokens,
                "step_bucket": step_bucket(cams * full.vision.tokens + text_tokens),
                "kernels": {r: round(t[r].kernels) for r in REGIONS},
                "kernels_total": round(sum(t[r].kernels for r in REGIONS)),
                "tflop": sum(t[r].flops for r in REGIONS) / 1e12,
                "gbytes": sum(t[r].bytes for r in REGIONS) / 1e9,
                "syncs": round(sum(t[r].syncs for r in REGIONS)),
                "region_ms": {r: region_ms(t[r], r in CAPTURED) for r in REGIONS},
                "busy_ms": 1e3 * sum(t[r].busy_s for r in REGIONS),
                "graph_gaps_ms": 1e3 * GRAPH_GAP_S * sum(t[r].kernels for r in REGIONS),
                "limit_ms_of_this_code": 1e3 * sum(x.ideal_s for x in limit_parts.values()),
                # bench/limit.py at this prefix (48 text tokens: 5.31 / 6.61 ms)
                "limit_ms": limit.limit_ms(cams, cams * full.vision.tokens + text_tokens),
                "estimate_ms": today,
                "estimate_all_graphs_ms": all_graphs,
                "estimate_all_graphs_row_bucket_ms": row_bucket,
            }
        )
        r = rows[-1]
        r["ratio"] = r["estimate_ms"] / r["limit_ms"]
    return {
        "benchmark": "estimate",
        "device": "H100 SXM (estimated; no GPU run)",
        "assumptions": {
            "peak_tflops_bf16": H100["flops_per_s"] / 1e12,
            "peak_tflops_fp32": H100["fp32_flops_per_s"] / 1e12,
            "hbm_tb_per_s": H100["bytes_per_s"] / 1e12,
            "compute_eff": COMPUTE_EFF,
            "memory_eff": MEMORY_EFF,
            "graph_gap_us": GRAPH_GAP_S * 1e6,
            "eager_launch_us": EAGER_LAUNCH_S * 1e6,
            "step_latency_us": STEP_LATENCY_S * 1e6,
            "text_tokens": text_tokens,
            "captured_regions": sorted(CAPTURED),
        },
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="embodied-kv bench estimate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default="pi05", choices=["pi05"], help="only pi05 is estimated")
    p.add_argument("--quick", action="store_true", help="accepted for uniformity; no effect")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--text-tokens", type=int, default=TEXT_TOKENS)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (as every bench)")
    a = p.parse_args(argv)
    a.device = "cpu"  # the census runs on the CPU whatever device it estimates
    env = harness.Environment.start(a, argv)
    result = estimate(text_tokens=a.text_tokens)
    print_table(
        "cams kernels TFLOP GB limit busy gaps today graphs rowpad x".split(),
        [
            [
                r["cameras"],
                r["kernels_total"],
                r["tflop"],
                r["gbytes"],
                r["limit_ms"],
                r["busy_ms"],
                r["graph_gaps_ms"],
                r["estimate_ms"],
                r["estimate_all_graphs_ms"],
                r["estimate_all_graphs_row_bucket_ms"],
                r["ratio"],
            ]
            for r in result["rows"]
        ],
    )
    for r in result["rows"]:
        parts = ", ".join(
            f"{k} {r['kernels'][k]} kernels {v:.2f} ms" for k, v in r["region_ms"].items()
        )
        print(f"  {r['cameras']} cameras: {parts}")
    harness.finish(result, env, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
