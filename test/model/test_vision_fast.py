"""The SigLIP encoder's fast path (model/vision_fast.py) against HF's eager forward: the
same outputs (fp32 tight, bf16 within the eager path's own bf16 error), weights loaded
after the first forward reach it, gradients match, and it launches fewer kernels."""

from contextlib import nullcontext

import pytest
import torch

import embodied_kv.kernels.add_layer_norm as residual_norm
from embodied_kv.bench.estimate import H100, add_layer_norm_cost, as_one_kernel
from embodied_kv.bench.kernel_census import Census, Roofline
from embodied_kv.kernels.triton_base import INTERPRETED, triton
from embodied_kv.model.config import get_preset
from embodied_kv.model.vision import VisionEncoder
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import load_weights, save_weights

TOL_FP32 = 1e-5  # relative to the output's max: SDPA sums the attention in another order
BF16_FACTOR = 2.0  # the fast path's bf16 error vs fp32 <= twice the eager path's
# q/k/v GEMM, SDPA, out_proj GEMM, add + LayerNorm, fc1 GEMM, GELU, fc2 GEMM, add + LayerNorm
MAX_KERNELS_PER_LAYER = 8  # as on CUDA: each add + LayerNorm one Triton kernel
MAX_CPU_OPS_PER_LAYER = 10  # on the CPU each is its reference, two ops
EAGER_ONLY_OPS = ("bmm", "softmax", "clone", "_to_copy", "mul")  # attention as plain ops


def config(name: str, **kw):
    return get_preset(name, tokenizer="bytes", **kw)  # the vision tower is the preset's


def images(cfg, cams: int = 2, seed: int = 0) -> torch.Tensor:
    s = cfg.vision.image_size
    g = torch.Generator().manual_seed(seed)
    return torch.rand(cams, 3, s, s, generator=g) * 2 - 1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def perturbed(cfg):
    """Other vision weights of the same config (fp32)."""
    m = build_model(cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in m.vision.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def fusion_in_use(vision: VisionEncoder) -> bool:
    f = vision.fast.fusions[0]
    q = vision.tower.encoder.layers[0].self_attn.q_proj.weight
    return f.current() and q.untyped_storage().data_ptr() == f.weight.data_ptr()


@pytest.mark.parametrize("name", ["tiny", "world"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fast_path_equals_hf_eager_after_a_load(tmp_path, name, dtype):
    cfg = config(name)
    m = build_model(cfg, dtype=dtype)
    imgs = images(cfg)
    before = m.vision(imgs)  # fuses q/k/v over the random weights
    assert fusion_in_use(m.vision)
    src = perturbed(cfg)
    save_weights(src, tmp_path / "w.safetensors")
    load_weights(m, tmp_path / "w.safetensors")  # copied in place into the fused views
    fast = m.vision(imgs)
    ref = m.vision(imgs, reference=True)
    gold = src.vision(imgs, reference=True)  # fp32 eager over the loaded weights
    assert fusion_in_use(m.vision)
    assert rel_err(before, gold) > 0.05, "the load must change the output"
    err, eager_err = rel_err(fast, gold), rel_err(ref, gold)
    print(f"{name} {dtype}: fast vs fp32 eager {err:.2e}, eager vs fp32 eager {eager_err:.2e}")
    if dtype == torch.float32:
        assert err <= TOL_FP32 and rel_err(fast, ref) <= TOL_FP32
    else:
        assert 0 < eager_err < 0.05
        assert err <= BF16_FACTOR * eager_err


@torch.no_grad()
def test_a_replaced_or_moved_weight_is_fused_again():
    cfg = config("tiny")
    m = build_model(cfg)
    v, imgs = m.vision, images(cfg)
    v(imgs)
    attn = v.tower.encoder.layers[1].self_attn
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)
    assert not v.fast.fusions[1].current() and v.fast.fusions[0].current()
    assert rel_err(v(imgs), v(imgs, reference=True)) <= TOL_FP32
    assert v.fast.fusions[1].current()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == v.fast.fusions[1].weight.data_ptr()
    v.double()  # every parameter replaced
    assert not any(f.current() for f in v.fast.fusions)
    out = v(imgs.double())
    # HF's eager softmax runs in fp32 whatever the dtype: that is the 1e-7 here
    assert out.dtype == torch.float64 and rel_err(out, v(imgs.double(), reference=True)) < 1e-6
    assert all(f.current() for f in v.fast.fusions)


def test_gradients_match_eager_and_a_step_reaches_the_fused_weights():
    cfg = config("tiny")
    m = build_model(cfg)
    v, imgs = m.vision, images(cfg)
    with torch.no_grad():
        v(imgs)  # the q/k/v Parameters now view the fused storage
    weight = torch.randn(v(imgs).shape, generator=torch.Generator().manual_seed(3))
    grads = {}
    for reference in (True, False):
        v.zero_grad(set_to_none=True)
        (v(imgs, reference=reference) * weight).sum().backward()
        grads[reference] = {n: p.grad.clone() for n, p in v.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    scale = max(float(g.abs().max()) for g in grads[True].values())
    for n, g in grads[True].items():
        if n.endswith("k_proj.bias"):  # softmax ignores a per-query shift: zero but rounding
            assert max(g.abs().max(), grads[False][n].abs().max()) <= 1e-5 * scale, n
        else:
            assert rel_err(grads[False][n], g) <= 1e-4, n
    torch.optim.SGD(v.parameters(), lr=0.5).step()  # in place, into the fused views
    with torch.no_grad():
        assert fusion_in_use(v)
        fast, ref = v(imgs), v(imgs, reference=True)
    assert rel_err(fast, ref) <= TOL_FP32


def kernels(vision: VisionEncoder, imgs: torch.Tensor, reference: bool, cuda: bool) -> Census:
    """The census of one forward; `cuda`: the Triton kernels counted as the one kernel each
    is on CUDA (bench/estimate.py's as_one_kernel)."""
    with torch.no_grad():
        vision(imgs, reference=reference)  # warm-up, as before a graph capture
        census = Census(Roofline(**H100))
        fused = as_one_kernel(census, residual_norm, "add_layer_norm", add_layer_norm_cost)
        with census, fused if cuda else nullcontext(), census.region("vision"):
            vision(imgs, reference=reference)
    return census


def pi05_width_tower(layers: int) -> VisionEncoder:
    """pi05's vision widths (1152, 16 heads of 72, mlp 4304) at `layers`, bf16 encoder."""
    cfg = get_preset("pi05", vision_layers=layers)
    with torch.device("meta"):
        v = VisionEncoder(cfg.vision, cfg.backbone.width)
    v = v.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in v.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=g))
    v.reset_buffers()
    v.to(torch.bfloat16)
    v.tower.embeddings.float()  # model/precision.py
    return v


@pytest.mark.parametrize("preset", ["tiny", "pi05"])
def test_fast_path_launches_fewer_kernels(preset):
    counts, ops = {}, {}
    for depth in (1, 2):
        if preset == "pi05":
            v, imgs = pi05_width_tower(depth), images(get_preset("pi05"), cams=1)
        else:
            cfg = config(preset, vision_layers=depth)
            v, imgs = build_model(cfg, dtype=torch.bfloat16).vision, images(cfg, cams=1)
        for path in ("eager", "cpu", "cuda"):
            census = kernels(v, imgs, reference=path == "eager", cuda=path == "cuda")
            counts[depth, path] = census.tallies["vision"].kernels
            ops[depth, path] = {op for (_, op), t in census.by_op.items() if t.kernels}
    per_layer = {path: counts[2, path] - counts[1, path] for path in ("eager", "cpu", "cuda")}
    print(f"{preset}: kernels per layer {per_layer}; one-layer tower "
          f"{ {p: counts[1, p] for p in per_layer} }")  # fmt: skip
    assert per_layer["cuda"] <= MAX_KERNELS_PER_LAYER < per_layer["eager"]
    assert per_layer["cpu"] <= MAX_CPU_OPS_PER_LAYER
    for path in ("cpu", "cuda"):  # embeddings, projector: unchanged
        assert counts[1, path] - per_layer[path] == counts[1, "eager"] - per_layer["eager"]
    per_layer_ops = ops[2, "cpu"] - {op for op in ops[1, "cpu"] if "_to_copy" in op}
    assert not [op for op in per_layer_ops if any(e in op for e in EAGER_ONLY_OPS)], ops
    assert any("scaled_dot_product" in op for op in ops[1, "cpu"])
    assert "single_kernel" in ops[1, "cuda"]


@pytest.mark.skipif(
    triton is None or not INTERPRETED,
    reason="the add + LayerNorm kernel on CPU tensors needs TRITON_INTERPRET=1 (on a GPU "
    "machine test/kernels/test_add_layer_norm.py runs it compiled)",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fast_path_through_the_triton_kernel(monkeypatch, dtype):
    """The tower as CUDA runs it: every add + LayerNorm by the Triton kernel (here under
    the interpreter), against HF's eager forward."""
    cfg = config("world")
    m = build_model(cfg, dtype=dtype)
    gold = build_model(cfg).vision(images(cfg), reference=True)
    ref = m.vision(images(cfg), reference=True)
    calls = []

    def kernel(*args):
        calls.append(args[0].shape)
        return residual_norm.add_layer_norm_kernel(*args)

    monkeypatch.setattr(residual_norm, "add_layer_norm", kernel)
    out = m.vision(images(cfg))
    assert len(calls) == 2 * cfg.vision.layers
    err, eager_err = rel_err(out, gold), rel_err(ref, gold)
    print(f"triton {dtype}: fast vs fp32 eager {err:.2e}, eager vs fp32 eager {eager_err:.2e}")
    if dtype == torch.float32:
        assert err <= TOL_FP32
    else:
        assert err <= BF16_FACTOR * eager_err


def test_kernel_count_does_not_grow_with_cameras():
    """Cameras are one batch: 3 cameras launch what 1 does (HF eager: 3 copies per layer
    more, its attention reshapes non-contiguous rows)."""
    cfg = config("tiny")
    v = build_model(cfg, dtype=torch.bfloat16).vision
    counts = {
        (cams, reference): kernels(v, images(cfg, cams), reference, cuda=True)
        .tallies["vision"]
        .kernels
        for cams in (1, 3)
        for reference in (True, False)
    }
    assert counts[3, False] == counts[1, False]
    assert counts[3, True] > counts[1, True]
