"""The candidates `bench/kernel_sweep.py` times for each kernel of the expert's layer-step:
(label, make(L) -> (out, call)), where call() writes out, which the sweep's check poisons
first; out None: call() returns its output (torch's own ops). `dry`: one configuration per
kernel (the CPU's check under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from embodied_kv.kernels import expert_attention as attn_k
from embodied_kv.kernels import expert_layer_step as step_k
from embodied_kv.kernels import gemm_residual as res_k
from embodied_kv.kernels import norm_gate_up as gate_k
from embodied_kv.kernels import norm_qkv_rope as qkv_k
from embodied_kv.kernels.gated_rms_norm import plan_gated_rms_norm
from embodied_kv.kernels.prefill_tile import TileConfig
from embodied_kv.kernels.rope import adjacent_view, plan_rope

EPS = 1e-6


@contextmanager
def patched(module, **values):
    """Module constants set for the block (the plan functions read them at call time)."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def qk_views(L, s):
    n, d, hq, hkv = s["n"], s["d"], s["hq"], s["hkv"]
    q, k, _ = L["qkv"].split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(n, hq, d), k.view(n, hkv, d)


def attn_sdpa(L, s, tag=""):
    """torch's SDPA over the concatenated K/V (cuDNN / flash / efficient, as torch picks)."""
    k = torch.cat([L["kp" + tag], L["ks"]]).permute(1, 0, 2)[None]
    v = torch.cat([L["vp" + tag], L["vs"]]).permute(1, 0, 2)[None]
    q = L["q"].permute(1, 0, 2)[None]
    mask = (L["bias" + tag] == 0)[None, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o[0].permute(1, 0, 2)


def qkv_candidates(s, dry):
    grid = [(64, 16, 4, 3)] if dry else [
        (bk, bh, nw, ns) for bk in (256, 128, 64) for bh in (16, 32) for nw, ns in
        ((4, 3), (8, 3), (4, 4))]  # fmt: skip
    for bk, bh, nw, ns in grid:
        def make(L, bk=bk, bh=bh, nw=nw, ns=ns):
            heads = s["hq"] + 2 * s["hkv"]
            out = torch.empty(s["n"], heads, s["d"], dtype=L["h"].dtype, device=L["h"].device)
            with patched(qkv_k, QKV_BLOCK_K=bk, QKV_BLOCK_H=bh):
                launch = qkv_k.plan_norm_qkv_rope(L["h"], L["scale1"], L["shift"], EPS,
                                                  L["w_qkv"], s["hq"] + s["hkv"], L["cos"],
                                                  L["sin"], out)  # fmt: skip
            launch = dataclasses.replace(launch, num_warps=nw, num_stages=ns)
            return out, launch.run
        yield f"block_k={bk} block_h={bh} warps={nw} stages={ns}", make


def gate_candidates(s, dry):
    grid = [(64, 32, 4, 3)] if dry else [
        (bk, bn, nw, ns) for bk in (256, 128, 64) for bn in (32, 64, 16) for nw, ns in
        ((4, 3), (8, 3))]  # fmt: skip
    for bk, bn, nw, ns in grid:
        def make(L, bk=bk, bn=bn, nw=nw, ns=ns):
            out = torch.empty(s["n"], s["f"], dtype=L["h"].dtype, device=L["h"].device)
            with patched(gate_k, GATE_BLOCK_K=bk, GATE_BLOCK_N=bn):
                launch = gate_k.plan_norm_gate_up(L["h"], L["scale1"], L["shift"], EPS,
                                                  L["w_gu"], out)  # fmt: skip
            launch = dataclasses.replace(launch, num_warps=nw, num_stages=ns)
            return out, launch.run
        yield f"block_k={bk} block_n={bn} warps={nw} stages={ns}", make


def res_candidates(s, dry, which):
    grid = [(64, 64, 2, 4, 3)] if dry else [
        (bn, bk, sk, nw, ns) for bn in (32, 64) for bk in (64, 128) for sk in (4, 8, 16)
        for nw, ns in ((4, 3),)]  # fmt: skip
    for bn, bk, sk, nw, ns in grid:
        def make(L, bn=bn, bk=bk, sk=sk, nw=nw, ns=ns):
            x, w = (L["x_o"], L["w_o"]) if which == "o" else (L["x_d"], L["w_d"])
            cfg = res_k.GemmConfig(min(64, max(16, 1 << (s["n"] - 1).bit_length())), bn, bk,
                                   sk, nw, ns)  # fmt: skip
            work = res_k.workspace(s["n"], s["w"], cfg, L["h"].device)
            out = torch.empty_like(L["h"])
            launches = res_k.plan_linear_gated_residual(L["h"], x, w, L["gate"], out, work, cfg)
            return out, lambda: [la.run() for la in launches]
        yield f"block_n={bn} block_k={bk} split_k={sk} warps={nw} stages={ns}", make


def attn_candidates(s, dry, tag=""):
    # torch's own attention, ranked beside the kernel's configurations (checked dry too)
    yield "torch_sdpa", lambda L: (None, lambda: attn_sdpa(L, s, tag))
    grid = [(4, attn_k.REDUCE, 16, 4, 2)] if dry else [
        (bps, reduce, 16, 4, 2) for bps in (1, 2, 4, 8) for reduce in attn_k.REDUCES
    ] + [(2, "launch", 16, 8, 2), (2, "launch", 16, 4, 3), (4, "launch", 32, 8, 2),
         (4, "queue", 16, 4, 3)]  # fmt: skip
    for bps, reduce, bn, nw, ns in grid:
        def make(L, bps=bps, reduce=reduce, bn=bn, nw=nw, ns=ns):
            base = attn_k.tile_config(L["q"].dtype, s["hq"] // s["hkv"])
            cfg = TileConfig(base.block_m, base.group_pad, bn, nw, ns)
            with patched(attn_k, BLOCKS_PER_SPLIT=bps, tile_config=lambda *a: cfg):
                work = attn_k.expert_workspace(s["n"], s["hq"], s["hkv"], s["d"],
                                               s["bucket" + tag], L["q"].dtype, L["q"].device)
                out = torch.empty_like(L["q"])
                launches = attn_k.plan_expert_attention(L["q"], L["kp" + tag], L["vp" + tag],
                                                        L["ks"], L["vs"], s["d"] ** -0.5,
                                                        L["bias" + tag], out, work, reduce)
            return out, lambda: [la.run() for la in launches]
        label = f"blocks_per_split={bps} reduce={reduce} block_n={bn} warps={nw}"
        yield f"{label} stages={ns}", make


def rope_pair_launch(L, s):
    """(out [N, Hq + Hkv, D], the launch rotating q and k into it): kernels/rope.py rope_pair
    over the fused q/k/v output's adjacent q and k heads."""
    both = adjacent_view(*qk_views(L, s))
    out = torch.empty(both.shape, dtype=both.dtype, device=both.device)
    return out, plan_rope(both, L["cos"], L["sin"], out)


def fusion_candidates(s, which):
    """The chain's own fusions, one configuration each: the gated residual + norm kernel,
    RoPE over q and k in one launch."""
    def make(L):
        n, w = s["n"], s["w"]
        if which == "gated":
            out = torch.empty(n, 2 * w, dtype=L["h"].dtype, device=L["h"].device)
            launch = plan_gated_rms_norm(L["h"], L["y"], L["gate"], L["scale1"], L["shift"],
                                         EPS, out[:, :w], out[:, w:])  # fmt: skip
        else:
            out, launch = rope_pair_launch(L, s)
        return out, launch.run
    yield ("one kernel" if which == "gated" else "one launch over q and k"), make


def rope_attn_candidates(s):
    """The RoPE launch over q and k then the attention (2026-12-04's chain), and the
    attention rotating them itself (one launch fewer)."""
    for on_load in (False, True):
        def make(L, on_load=on_load):
            q, k = qk_views(L, s)
            launches = []
            if not on_load:
                rotated, launch = rope_pair_launch(L, s)
                launches.append(launch)
                q, k = rotated[:, : s["hq"]], rotated[:, s["hq"] :]
            work = attn_k.expert_workspace(s["n"], s["hq"], s["hkv"], s["d"], s["bucket"],
                                           q.dtype, q.device)  # fmt: skip
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            launches += attn_k.plan_expert_attention(
                q, L["kp"], L["vp"], k, L["vs"], s["d"] ** -0.5, L["bias"], out, work,
                attn_k.REDUCE, (L["cos"], L["sin"]) if on_load else None,
            )  # fmt: skip
            return out, lambda: [la.run() for la in launches]
        yield ("rope on load" if on_load else "rope_pair, then the attention"), make


def step_candidates(s):
    """The fused layer-step as one persistent launch (kernels/expert_layer_step.py), one and
    two programs a SM, against its five launches (the row's chain)."""
    def make(L, per_sm):
        heads = (s["hq"], s["hkv"], s["d"])
        work = step_k.StepWork.new(L["h"], L["w_qkv"], L["w_o"], L["w_d"], heads, s["bucket"])
        out = torch.empty_like(L["h"])
        pair = lambda x: (x, x)  # noqa: E731 - one norm and gate for both of the layer's
        launch = step_k.plan_layer_step(
            L["h"], pair(L["scale1"]), pair(L["shift"]), pair(EPS), pair(L["gate"]), L["w_qkv"],
            heads, L["cos"], L["sin"], L["kp"], L["vp"], L["bias"], s["d"] ** -0.5, L["w_o"],
            L["w_gu"], L["w_d"], work, out, per_sm=per_sm,
        )  # fmt: skip
        return out, launch.run
    for per_sm in (1, 2):
        yield f"persistent per_sm={per_sm}", lambda L, p=per_sm: make(L, p)
