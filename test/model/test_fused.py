"""q/k/v and gate/up as one GEMM each (model/fused.py): the checkpoint's parameters become
views of one storage. Same outputs as separate GEMMs, same names and bytes saved, loads
reach the fused path, and anything that breaks the views falls back to separate GEMMs."""

import torch

from embodied_kv.model.checkpoint import load_pi05_checkpoint, save_in_lerobot_layout
from embodied_kv.model.config import get_preset
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import load_weights, save_weights

TOL = 1e-5  # fp32: one GEMM over the concatenated rows may sum in another order


def outputs(model):
    """Prefix logits and an action chunk: every fused layer of backbone and expert."""
    arena = model.new_arena(2, 256)
    slot = arena.allocate()
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 3, "stack the cups"))
    logits = model.prefill(arena, slot, prefix)
    n = prefix.embeds.shape[0]
    return logits, model.sample_actions(arena, slot, n, model.make_noise(1))


def fused_model():
    m = build_model(get_preset("tiny"))
    assert fuse_projections(m) == 2 * m.cfg.backbone.layers  # backbone + expert layers
    return m


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def close(a, b):
    return all(torch.allclose(x, y, atol=TOL, rtol=TOL) for x, y in zip(a, b, strict=True))


def test_fused_layers_compute_what_separate_gemms_do():
    plain, fused = build_model(get_preset("tiny")), fused_model()
    assert plain.state_dict().keys() == fused.state_dict().keys()
    assert same_weights(plain, fused)
    attn = fused.backbone.layers[0].self_attn
    fusion = attn.fusion
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fusion.weight.data_ptr()
    with torch.no_grad():
        assert fusion.usable() and fused.expert.layers[0].mlp.fusion.usable()
    assert not fusion.usable()  # autograd on: the fused tensor would take no gradient
    assert close(outputs(plain), outputs(fused))


def test_saving_and_loading_go_through_the_views(tmp_path):
    source = build_model(get_preset("tiny"))
    torch.manual_seed(7)
    with torch.no_grad():  # other weights of the same config
        for p in source.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_weights(source, tmp_path / "src.safetensors")
    fused = fused_model()
    save_weights(fused, tmp_path / "fused.safetensors")  # views of a shared storage: saved
    plain = build_model(get_preset("tiny"))
    load_weights(plain, tmp_path / "fused.safetensors")
    assert same_weights(plain, fused)
    load_weights(fused, tmp_path / "src.safetensors")  # copied into the views in place
    with torch.no_grad():
        assert fused.backbone.layers[1].self_attn.fusion.usable()
    assert close(outputs(source), outputs(fused))
    save_in_lerobot_layout(source, tmp_path / "lerobot.safetensors")  # a real layout too
    refused = fused_model()
    load_pi05_checkpoint(refused, tmp_path / "lerobot.safetensors")
    assert close(outputs(source), outputs(refused))


def test_a_replaced_or_moved_weight_falls_back_to_separate_gemms():
    fused, plain = fused_model(), build_model(get_preset("tiny"))
    attn = fused.expert.layers[0].self_attn
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach() * 2)
    plain.expert.layers[0].self_attn.v_proj.weight.data.mul_(2)
    with torch.no_grad():
        assert not attn.fusion.usable() and fused.expert.layers[1].self_attn.fusion.usable()
    assert close(outputs(plain), outputs(fused))
    fused.double()  # every parameter replaced: the fused tensors are stale, never used
    with torch.no_grad():
        assert not any(layer.self_attn.fusion.usable() for layer in fused.backbone.layers)
