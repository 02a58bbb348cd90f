"""The action expert's per-sample precomputation: what the 10 Euler steps share is
computed once, and equals what each step computed on its own before (bytes where the
arithmetic is the same, fp32 rounding where a batched GEMM sums in another order)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from embodied_kv.bench.estimate import H100, cuda_kernels
from embodied_kv.bench.kernel_census import Census, Roofline
from embodied_kv.kernels.expert_attention import REDUCE
from embodied_kv.model.config import get_preset
from embodied_kv.model.expert import PERSISTENT_EULER_STEP, PERSISTENT_LAYER_STEP
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.layers import Rope
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

# The modulation GEMM over 10 flow-time rows vs 10 one-row GEMMs: fp32 sums in another
# order. Measured max |diff| on the tiny preset ~2e-7 (values ~1); a chunk ~1e-6.
MODULATION_ATOL = 1e-5
CHUNK_ATOL = 1e-4
# Kernels per expert layer per Euler step as CUDA runs them (bf16; each RMSNorm, RoPE and
# the attention and the GELU-gate one Triton kernel): 76 before the per-sample precomputation
# and the fused kernels, 15 after, 16 since the attention is split over the prefix (partials
# + reduce), 13 with q/k/v and gate/up one GEMM each (model/fused.py), 6 with the layer-step's
# fused kernels (model/expert_step.py: norm->q/k/v+RoPE, attention + its reduce, o_proj +
# gated residual, norm->gate/up+GELU-gate, down + gated residual), 5 with the attention's reduce
# inside (issue 33 asked <= 5), 6 again since an H200 timed that reduce inside at 39.4 us a
# call against 13.7 us for partials + reduce (kernels/expert_attention.py REDUCE "last"), 5
# since the partials and their reduce run as one persistent launch (REDUCE "queue").
# 1 with the five as one persistent launch (kernels/expert_layer_step.py,
# model/expert.py PERSISTENT_LAYER_STEP); 0 with all the layers of an Euler step in one
# (PERSISTENT_EULER_STEP: a layer more adds no launch).
ONE_STEP = PERSISTENT_LAYER_STEP and PERSISTENT_EULER_STEP
MAX_KERNELS_PER_LAYER_STEP = (0 if ONE_STEP else 1 if PERSISTENT_LAYER_STEP
                              else 6 if REDUCE == "launch" else 5)  # fmt: skip
# The chain (CUDA's default, model/expert.py FUSED_LAYER_STEP): q/k/v GEMM, the attention's
# partials (RoPE on q and k as they are loaded) + reduce, o_proj, gated residual +
# post-attention norm, gate/up, GELU-gate, down, gated residual + the next layer's input norm
# (kernels/gated_rms_norm.py): 9, from 13 (10 on 2026-12-04, then RoPE into the attention);
# 8 with the partials and reduce one persistent launch.
CHAIN_KERNELS_PER_LAYER_STEP = 9 if REDUCE == "launch" else 8


def prefilled(m, seed=3):
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, seed)))
    return arena, slot, arena.slot_len(slot)


def times_of(m):
    steps = m.cfg.denoise_steps
    return (1.0 + torch.arange(steps, dtype=torch.float64) * (-1.0 / steps)).float()


def test_modulation_table_equals_each_steps_own(tiny_model):
    e = tiny_model.expert
    times = times_of(tiny_model)
    mod = e.modulation(times)
    norms = e.norms()
    assert mod.scale1.shape == (len(norms), len(times), tiny_model.cfg.expert.width)
    worst = 0.0
    for k, t in enumerate(times):
        cond = e.time_cond(t)
        for n, norm in enumerate(norms):
            scale1, shift, gate = norm.modulation(cond)
            for table, own in ((mod.scale1, scale1), (mod.shift, shift), (mod.gate, gate)):
                worst = max(worst, (table[n, k] - own).abs().max().item())
    assert worst < MODULATION_ATOL


def test_rope_rotation_is_the_half_split_formula_in_bytes():
    rope = Rope(32, 512, 10_000.0)
    position = torch.tensor([0, 1, 7, 300, 511, 42])
    inv = 1.0 / (10_000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    ang = position.double()[:, None] * inv[None]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]  # [N, 1, 16]
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 3, 32, generator=g).to(dtype)
        x1, x2 = x.float().chunk(2, dim=-1)
        want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
        assert torch.equal(rope(x, position), want)


def test_sample_equals_step_by_step_velocity(tiny_model):
    """sample (modulation of all times at once, one context) = the Euler loop over
    `velocity`, which computes each step's condition and modulation on its own."""
    m = tiny_model
    arena, slot, n = prefilled(m)
    noise = m.make_noise(1)
    chunk = m.expert.sample(arena, slot, n, noise)
    x, dt = noise.float(), -1.0 / m.cfg.denoise_steps
    with torch.no_grad():
        for t in times_of(m):
            x = x + dt * m.expert.velocity(x, t, arena, slot, n).float()
    assert (chunk - x).abs().max().item() < CHUNK_ATOL
    masked = m.expert.sample(arena, slot, torch.tensor(n), noise, rows=256)
    assert (chunk - masked).abs().max().item() < CHUNK_ATOL


class ArenaCasts(TorchDispatchMode):
    """Counts dtype casts whose input is a view of the arena's K or V."""

    def __init__(self, arena):
        super().__init__()
        self.ptrs = {arena.k.untyped_storage().data_ptr(), arena.v.untyped_storage().data_ptr()}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += args[0].untyped_storage().data_ptr() in self.ptrs
        return func(*args, **(kwargs or {}))


def test_bf16_attention_reads_the_prefix_without_a_cast():
    """Under bf16 the prefix K/V are read in place in their dtype in every step (they
    were cast to fp32 once per layer and step: 1.3 GB per action at pi05)."""
    m = build_model(get_preset("tiny"), dtype=torch.bfloat16)
    arena, slot, n = prefilled(m)
    with ArenaCasts(arena) as probe:
        chunk = m.expert.sample(arena, slot, n, m.make_noise(0))
    assert probe.casts == 0
    assert chunk.dtype == torch.float32 and torch.isfinite(chunk).all()


def kernels_per_layer_step(fused: bool) -> float:
    steps = get_preset("tiny").denoise_steps
    counts = {}
    for depth in (1, 2):
        m = build_model(get_preset("tiny", layers=depth), dtype=torch.bfloat16)
        fuse_projections(m)  # as on CUDA
        m.expert.fused_layer_step = fused
        arena, slot, n = prefilled(m)
        # warm-up (as graph capture is): what is computed once per weights load (the flow
        # modulation table, model/flow_constants.py) is not part of an action
        m.expert.sample(arena, slot, torch.tensor(n), m.make_noise(0), rows=256)
        census = Census(Roofline(**H100))
        with census, cuda_kernels(census), census.region("denoise"):
            m.expert.sample(arena, slot, torch.tensor(n), m.make_noise(0), rows=256)
        counts[depth] = census.tallies["denoise"].kernels
    return (counts[2] - counts[1]) / steps


def test_denoise_kernels_per_layer_step_stay_few():
    per_layer_step = kernels_per_layer_step(fused=True)
    assert per_layer_step <= MAX_KERNELS_PER_LAYER_STEP, per_layer_step
    chain = kernels_per_layer_step(fused=False)
    assert chain == CHAIN_KERNELS_PER_LAYER_STEP, chain


def test_the_untimed_fusions_switched_off_are_the_same_bytes_here():
    """bench latency's graphs_prev runs the expert's RoPE launch before its attention and the
    backbone's ops apart (model/expert.py rope_in_attention, model/backbone.py
    fused_epilogues): on a CPU both paths are the same ops, so the same chunk in bytes."""
    chunks = []
    for on in (True, False):
        m = build_model(get_preset("tiny"))
        m.expert.rope_in_attention = m.backbone.fused_epilogues = on
        arena, slot, n = prefilled(m)
        chunks.append(m.expert.sample(arena, slot, n, m.make_noise(0)))
    assert torch.equal(*chunks)
