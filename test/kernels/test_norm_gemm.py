"""Norm-folded GEMM kernels (kernels/norm_gemm.py) vs their references, interpreter on CPU:
row counts that end mid-block (1, 7, 50, 67), widths that end mid-K-tile, head_dims whose half
is no tile width (16: half 8; 48: half 24), fp32, bf16 and fp16; the CPU path's bytes against the
model's own modules; refused shapes; the pi05 launches."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from embodied_kv.kernels.norm_gemm import (
    norm_gate_up,
    norm_gate_up_kernel,
    norm_gate_up_ref,
    norm_qkv_rope,
    norm_qkv_rope_kernel,
    norm_qkv_rope_ref,
    pi05_launches,
)
from embodied_kv.model.config import GemmaConfig
from embodied_kv.model.layers import GemmaLayer, Rope

from .conftest import DEVICE, FP32_TOL, LOW_PRECISION_FACTOR

EPS = 1e-6
LOW_PRECISION_ABS = 1e-3  # beside the factor: an output whose reference error is ~1 ulp
ROWS = [1, 7, 50, 67]  # 50: pi05's action rows; 67: a second, partial 64-row block
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (width, Hq, Hkv, D, hidden)
DIMS = [(96, 2, 1, 16, 80), (48, 3, 1, 48, 40)]


def inputs(n, width, dtype, seed=0, row_stride=None):
    """h [N, W] (row stride `row_stride` if given), scale1 and shift fp32 [W]."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, row_stride or width, generator=g) * 3 + 0.5
    h = wide.to(dtype).to(DEVICE)[:, :width]
    scale1 = (1.0 + 0.3 * torch.randn(width, generator=g)).to(DEVICE)
    shift = (0.3 * torch.randn(width, generator=g)).to(DEVICE)
    return h, scale1, shift


def weight(rows, width, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=g) * width**-0.5).to(dtype).to(DEVICE)


def tables(n, d, seed=2):
    """cos, sin [N, 1, D] of random positions, as the expert gathers them (Rope.at)."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = Rope(d, 1024, 10_000.0).at(torch.randint(0, 1024, (n,), generator=g))
    return cos.to(DEVICE), sin.to(DEVICE)


def assert_close_to_exact(out, ref, exact, dtype, what):
    assert out.dtype == dtype and out.shape == exact.shape, what
    err = (out.float() - exact).abs().max().item()
    if dtype == torch.float32:
        assert err <= FP32_TOL, f"{what}: fp32 kernel error {err:.3g}"
        return
    ref_err = (ref.float() - exact).abs().max().item()
    tol = LOW_PRECISION_FACTOR * ref_err + LOW_PRECISION_ABS
    assert err <= tol, f"{what}: kernel error {err:.3g} vs reference error {ref_err:.3g}"


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("dims", DIMS)
def test_gate_up_matches_reference(kernel, dims, n, dtype):
    width, *_, hidden = dims
    h, scale1, shift = inputs(n, width, dtype, seed=3)
    w = weight(2 * hidden, width, dtype, seed=4)
    out = norm_gate_up_kernel(h, scale1, shift, EPS, w, hidden)
    ref = norm_gate_up_ref(h, scale1, shift, EPS, w, hidden)
    exact = norm_gate_up_ref(h.float(), scale1, shift, EPS, w.float(), hidden)
    assert out.is_contiguous()
    assert_close_to_exact(out, ref, exact, dtype, "gelu(gate) * up")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_the_model_chain_in_bytes(dtype):
    """The dispatchers on CPU tensors against the expert's own modules (velocity_at's chain:
    AdaRMSNorm.modulate, Attention.qkv, Rope.rotate; GatedMLP), compared with torch.equal."""
    torch.manual_seed(5)
    cfg = GemmaConfig(width=96, layers=1, mlp=80, heads=2, kv_heads=1, head_dim=16)
    layer = GemmaLayer(cfg, adaptive=True).to(dtype)
    rope = Rope(cfg.head_dim, 256, cfg.rope_theta)
    attn, mlp = layer.self_attn, layer.mlp
    n = 50
    h = (torch.randn(n, cfg.width) * 2).to(dtype)
    cos_sin = rope.at(torch.arange(100, 100 + n))
    cond = torch.randn(cfg.width)
    with torch.no_grad():
        norm, post = layer.input_layernorm.float(), layer.post_attention_layernorm.float()
        scale1, shift, _ = norm.modulation(cond)
        q, k, v = attn.qkv(norm.modulate(h, scale1, shift))
        want_qkv = (rope.rotate(q, cos_sin), rope.rotate(k, cos_sin), v)
        w_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        sizes = [cfg.heads * cfg.head_dim] + 2 * [cfg.kv_heads * cfg.head_dim]
        got_qkv = norm_qkv_rope(h, scale1, shift, norm.eps, w_qkv, sizes, *cos_sin)
        for name, got, want in zip("qkv", got_qkv, want_qkv, strict=True):
            assert got.dtype == dtype and torch.equal(got, want), name

        scale1, shift, _ = post.modulation(cond)
        want_mlp = mlp(post.modulate(h, scale1, shift))  # down_proj(gelu(gate) * up)
        w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        act = norm_gate_up(h, scale1, shift, post.eps, w_gate_up, cfg.mlp)
        assert torch.equal(F.linear(act, mlp.down_proj.weight), want_mlp)


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
    with pytest.raises(ValueError, match=r"weight must be torch.float32 \[160, 64\].*\(64, 64\)"):
        norm_gate_up_kernel(h, scale1, shift, EPS, w, 80)
    with pytest.raises(ValueError, match=r"shift must be a contiguous fp32"):
        norm_gate_up_kernel(h, scale1, shift.half(), EPS, w, 32)
    with pytest.raises(ValueError, match=r"h must be \[N, W\].*\(4, 1, 64\)"):
        norm_gate_up_kernel(h[:, None], scale1, shift, EPS, w, 32)


def test_pi05_launches_cover_the_expert_step():
    """One launch per kernel at pi05 expert shapes; arguments in the kernel's order."""
    qkv, gate_up = pi05_launches()
    assert qkv.grid == (1, 10 * 8)  # 50 rows in one 64-row block; 10 heads x 128 / 16
    assert gate_up.grid == (1, 4096 // 32)
    for launch in (qkv, gate_up):
        assert launch.args[0].shape == (50, 1024) and launch.args[0].dtype == torch.bfloat16
        fn = getattr(launch.kernel, "fn", launch.kernel)  # the interpreter wraps the function
        names = [a for a in inspect.signature(fn).parameters if a not in launch.constexprs]
        assert len(names) == len(launch.args), launch.name
