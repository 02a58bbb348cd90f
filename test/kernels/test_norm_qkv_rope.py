"""Norm-folded q/k/v GEMM with RoPE (kernels/norm_qkv_rope.py) vs its reference, interpreter on
CPU: row counts that end mid-block (1, 7, 50, 67), widths that end mid-K-tile, head_dims whose
half is no tile width (16: half 8; 48: half 24), fp32, bf16 and fp16; the CPU path's bytes
against the model's own modules; refused shapes; the pi05 launch."""

import pytest
import torch

from embodied_kv.kernels.norm_qkv_rope import (
    norm_qkv_rope,
    norm_qkv_rope_kernel,
    norm_qkv_rope_ref,
    pi05_launches,
)
from embodied_kv.model.layers import Rope

from .conftest import DEVICE
from .norm_inputs import (
    DIMS,
    DTYPES,
    EPS,
    ROWS,
    assert_args_in_kernel_order,
    assert_close_to_exact,
    inputs,
    make_expert_layer,
    weight,
)


def tables(n, d, seed=2):
    """cos, sin [N, 1, D] of random positions, as the expert gathers them (Rope.at)."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = Rope(d, 1024, 10_000.0).at(torch.randint(0, 1024, (n,), generator=g))
    return cos.to(DEVICE), sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("dims", DIMS)
def test_qkv_rope_matches_reference(kernel, dims, n, dtype):
    width, hq, hkv, d, _ = dims
    h, scale1, shift = inputs(n, width, dtype, row_stride=width + 5)
    w = weight((hq + 2 * hkv) * d, width, dtype)
    sizes = [hq * d, hkv * d, hkv * d]
    cos, sin = tables(n, d)
    out = norm_qkv_rope_kernel(h, scale1, shift, EPS, w, sizes, cos, sin)
    ref = norm_qkv_rope_ref(h, scale1, shift, EPS, w, sizes, cos, sin)
    exact = norm_qkv_rope_ref(h.float(), scale1, shift, EPS, w.float(), sizes, cos, sin)
    for name, o, r, e in zip("qkv", out, ref, exact, strict=True):
        assert_close_to_exact(o, r, e, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_the_model_chain_in_bytes(dtype):
    """The dispatcher on CPU tensors against the expert's own modules (velocity_at's chain:
    AdaRMSNorm.modulate, Attention.qkv, Rope.rotate), compared with torch.equal."""
    cfg, layer, h, cond = make_expert_layer(dtype)
    rope = Rope(cfg.head_dim, 256, cfg.rope_theta)
    attn = layer.self_attn
    cos_sin = rope.at(torch.arange(100, 100 + h.shape[0]))
    with torch.no_grad():
        norm = layer.input_layernorm.float()
        scale1, shift, _ = norm.modulation(cond)
        q, k, v = attn.qkv(norm.modulate(h, scale1, shift))
        want_qkv = (rope.rotate(q, cos_sin), rope.rotate(k, cos_sin), v)
        w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        sizes = [cfg.heads * cfg.head_dim] + 2 * [cfg.kv_heads * cfg.head_dim]
        got_qkv = norm_qkv_rope(h, scale1, shift, norm.eps, w_qkv, sizes, *cos_sin)
        for name, got, want in zip("qkv", got_qkv, want_qkv, strict=True):
            assert got.dtype == dtype and torch.equal(got, want), name


def test_bad_shapes_are_refused(kernel):
    width, d = 64, 16
    h, scale1, shift = inputs(4, width, torch.float32)
    w = weight(4 * d, width, torch.float32)
    cos, sin = tables(4, d)
    sizes = [2 * d, d, d]
    with pytest.raises(ValueError, match=r"sizes \[32, 16, 8\]"):
        norm_qkv_rope_kernel(h, scale1, shift, EPS, w, [2 * d, d, d // 2], cos, sin)
    with pytest.raises(ValueError, match=r"weight must be .*\[64, 64\].*\(64, 48\)"):
        norm_qkv_rope_kernel(h, scale1, shift, EPS, w[:, :48], sizes, cos, sin)
    with pytest.raises(ValueError, match=r"cos must be fp32 \[4, 1, 16\].*\(3, 1, 16\)"):
        norm_qkv_rope_kernel(h, scale1, shift, EPS, w, sizes, cos[:3], sin)
    with pytest.raises(ValueError, match=r"scale1 must be a contiguous fp32 \[64\].*\(32,\)"):
        norm_qkv_rope_kernel(h, scale1[:32], shift, EPS, w, sizes, cos, sin)


def test_pi05_launch_covers_the_expert_step():
    """One launch at pi05 expert shapes; arguments in the kernel's order."""
    (qkv,) = pi05_launches()
    # 50 rows in one 64-row block; 10 heads x 128 / 16; K 128 (bf16: an H200's fastest of the
    # tiles that do not spill)
    assert qkv.grid == (1, 10 * 8)
    assert (qkv.constexprs["BLOCK_H"], qkv.constexprs["BLOCK_K"]) == (16, 128)
    assert_args_in_kernel_order(qkv)
