"""The kernel census behind `bench estimate`: exact counts on known ops, and the
action path's kernels scale with depth as the code's loops say."""

import torch

from embodied_kv.bench.estimate import H100, action_census, scaled
from embodied_kv.bench.kernel_census import Census, Roofline
from embodied_kv.kernels.prefill_tile import KEY_SPLITS
from embodied_kv.model.config import get_preset
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.vla import build_model


def test_views_are_free_and_matmuls_count_flops_and_bytes():
    census = Census(Roofline(**H100))
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with census, census.region("r"):
        c = a @ b  # one mm
        c.t().reshape(-1)  # a view and a copy (the transpose is not contiguous)
        c.add_(1.0)  # in place: one kernel
        d = c.view(16, 64)  # free
        int(d[0, 0])  # a device -> host read
    t = census.tallies["r"]
    assert (t.kernels, t.syncs) == (3, 1)
    assert t.flops == 2 * 64 * 32 * 16
    mm = census.by_op[("r", "aten.mm.default")]
    assert mm.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert mm.ideal_s == mm.bytes / H100["bytes_per_s"]  # memory-bound at this size


def test_action_path_kernels_scale_with_depth():
    by_depth = {}
    for depth in (1, 2):
        m = build_model(get_preset("tiny", layers=depth, vision_layers=depth))
        by_depth[depth] = action_census(m, 2, 16, graph_pad=True)
    per_layer = {r: by_depth[2][r].kernels - by_depth[1][r].kernels for r in by_depth[1]}
    steps = get_preset("tiny").denoise_steps
    # per layer: the same kernels every Euler step, plus the modulation GEMMs of its two
    # adaptive norms, once per action (model/expert.py)
    assert per_layer["denoise"] > 2 and (per_layer["denoise"] - 2) % steps == 0
    assert per_layer["prefill"] > 0 and per_layer["embed"] == per_layer["logits"] == 0
    at4 = scaled(by_depth, 4, 2)
    assert at4["prefill"].kernels == by_depth[1]["prefill"].kernels + 3 * per_layer["prefill"]


def test_a_kernel_whose_longest_program_loops_long_costs_its_chain():
    """A grid that leaves most SMs idle (the unsplit expert attention: 7 programs of 52 key
    steps, 83 us on the H100) is priced by its longest program's steps, not its bytes."""
    gpu = Roofline(**H100, step_latency_s=1e-6)
    census = Census(gpu)
    with census, census.region("r"):
        with census.single_kernel(lambda: (1e6, 1e3, 40)):  # latency-bound
            pass
        with census.single_kernel(lambda: [(1e6, 1e3, 2), (1e6, 1e9)]):  # partials, reduce
            pass
    t = census.tallies["r"]
    assert t.kernels == 3
    assert abs(t.busy_s - (40e-6 + 2e-6 + 1e9 / H100["bytes_per_s"])) < 1e-12
    compute, memory = 1e6 / H100["flops_per_s"], 1e9 / H100["bytes_per_s"]
    assert abs(t.ideal_s - (2 * compute + memory)) < 1e-15  # the limit has no latency


# The backbone's layer as CUDA runs it with the fused projections: the q/k/v GEMM, RoPE with
# the K/V store (kernels/rope_store.py), the attention (the tile, and its reduce when split
# over keys: prefill_tile.KEY_SPLITS), o_proj, the residual add + the post-attention norm,
# gate/up, GELU-gate, down, the residual add + the next norm (kernels/gated_rms_norm.py
# add_rms_norm): 9 (10 with the reduce), from 14 (2026-12-04: the two rotations, two
# index_put copies, two adds and a norm each apart).
PREFILL_KERNELS_PER_LAYER = 9 + (KEY_SPLITS > 1)


def test_prefill_kernels_per_layer():
    by_depth = {}
    for depth in (1, 2):
        m = build_model(get_preset("tiny", layers=depth, vision_layers=depth), dtype=torch.bfloat16)
        fuse_projections(m)  # as on CUDA
        by_depth[depth] = action_census(m, 2, 16, graph_pad=True)
    per_layer = by_depth[2]["prefill"].kernels - by_depth[1]["prefill"].kernels
    assert per_layer == PREFILL_KERNELS_PER_LAYER, per_layer
