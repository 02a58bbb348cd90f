"""The public pi0.5 checkpoint layout and the own layout, on tiny checkpoints written here."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from embodied_kv.model.checkpoint import (
    lerobot_key_map,
    lerobot_state_dict,
    load_pi05_checkpoint,
    save_in_lerobot_layout,
)
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import load_weights, save_weights, weights_digest

P = "paligemma_with_expert"
EMBED = f"model.{P}.paligemma.model.language_model.embed_tokens.weight"


@pytest.fixture(scope="module")
def source():
    return build_model(get_preset("tiny"))


@pytest.fixture(scope="module")
def source_chunk(source):
    return action_chunk(source)


def fresh():
    return build_model(get_preset("tiny", seed=1))


def action_chunk(model):
    arena = model.new_arena(1, 256)
    slot = arena.allocate()
    prefix = model.embed_prefix(synthetic_observation(model.cfg, 3))
    model.prefill(arena, slot, prefix)
    return model.sample_actions(arena, slot, prefix.embeds.shape[0], model.make_noise(7))


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert weights_digest(a) == weights_digest(b)


def test_key_map_names_the_public_keys():
    km = lerobot_key_map(get_preset("pi05"))
    theirs = set(km.values())
    for key in [
        f"{P}.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight",
        f"{P}.paligemma.model.vision_tower.vision_model.encoder.layers.26.mlp.fc2.bias",
        f"{P}.paligemma.model.vision_tower.vision_model.post_layernorm.weight",
        f"{P}.paligemma.model.multi_modal_projector.linear.weight",
        f"{P}.paligemma.model.language_model.layers.17.self_attn.q_proj.weight",
        f"{P}.paligemma.model.language_model.norm.weight",
        f"{P}.paligemma.model.language_model.embed_tokens.weight",
        f"{P}.gemma_expert.model.layers.0.input_layernorm.dense.bias",
        f"{P}.gemma_expert.model.norm.dense.weight",
        "action_in_proj.weight",
        "time_mlp_out.bias",
    ]:
        assert f"model.{key}" in theirs, key
    assert len(theirs) == len(km)
    assert km["expert.time_mlp_in.weight"] == "model.time_mlp_in.weight"
    assert km["backbone.layers.3.mlp.up_proj.weight"].endswith(
        "language_model.layers.3.mlp.up_proj.weight"
    )


@pytest.mark.parametrize(
    "prefix,old_time_names,head",
    [
        (True, False, "embed"),
        (False, False, "lm_head"),
        (True, True, "both"),
        (False, True, "embed"),
    ],
)
def test_lerobot_layout_loads_exactly(tmp_path, source, source_chunk, prefix, old_time_names, head):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path, prefix=prefix, old_time_names=old_time_names, head=head)
    keys = load_file(str(path)).keys()
    assert all(k.startswith("model.") == prefix for k in keys)
    assert any("action_time_mlp_in" in k for k in keys) == old_time_names
    model = fresh()
    if head == "embed" and prefix:
        assert not torch.equal(action_chunk(model), source_chunk)
    report = load_pi05_checkpoint(model, tmp_path)  # the directory form
    assert report.loaded == len(model.state_dict())
    assert_same_weights(model, source)
    assert torch.equal(action_chunk(model), source_chunk)
    if head == "both":
        assert any(k.endswith("paligemma.lm_head.weight") for k in report.ignored)


def test_sharded_checkpoint_with_index(tmp_path, source):
    whole = tmp_path / "whole.safetensors"
    save_in_lerobot_layout(source, whole)
    tensors = load_file(str(whole))
    keys = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    ckpt = tmp_path / "sharded"
    ckpt.mkdir()
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(ckpt / name))
        weight_map.update(dict.fromkeys(ks, name))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = fresh()
    load_pi05_checkpoint(model, ckpt)
    assert_same_weights(model, source)


def test_paligemma_paths_of_old_transformers(tmp_path, source):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path, prefix=False, head="lm_head")
    old = {
        f"{P}.paligemma.model.language_model.": f"{P}.paligemma.language_model.model.",
        f"{P}.paligemma.lm_head.": f"{P}.paligemma.language_model.lm_head.",
        f"{P}.paligemma.model.vision_tower.": f"{P}.paligemma.vision_tower.",
        f"{P}.paligemma.model.multi_modal_projector.": f"{P}.paligemma.multi_modal_projector.",
    }

    def rename(tensors):
        for key in list(tensors):
            for new, legacy in old.items():
                if key.startswith(new):
                    tensors[legacy + key[len(new) :]] = tensors.pop(key)

    rewrite(path, rename)
    model = fresh()
    report = load_pi05_checkpoint(model, path)
    assert_same_weights(model, source)
    assert f"{P}.paligemma.language_model.lm_head.weight -> backbone.embed_tokens.weight" in (
        report.aliases
    )


def test_bf16_checkpoint_is_converted(tmp_path, source):
    path = tmp_path / "bf16.safetensors"
    save_in_lerobot_layout(source, path, dtype=torch.bfloat16)
    model = fresh()
    load_pi05_checkpoint(model, path)
    for k, t in model.state_dict().items():
        assert t.dtype == torch.float32
        assert torch.equal(t, source.state_dict()[k].to(torch.bfloat16).float()), k


def test_unused_public_keys_are_ignored(tmp_path, source):
    extra = {
        f"model.{P}.gemma_expert.lm_head.weight": torch.zeros(3, 64),
        f"model.{P}.gemma_expert.model.embed_tokens.weight": torch.zeros(3, 64),
        "model.state_proj.weight": torch.zeros(64, 8),
    }
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path, extra=extra)
    model = fresh()
    report = load_pi05_checkpoint(model, path)
    assert sorted(report.ignored) == sorted(extra)
    assert_same_weights(model, source)


def rewrite(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(tmp_path, source):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path)
    gone = f"model.{P}.gemma_expert.model.layers.2.post_attention_layernorm.dense.weight"
    rewrite(path, lambda t: t.pop(gone))
    with pytest.raises(ValueError, match="1 missing") as err:
        load_pi05_checkpoint(fresh(), path)
    assert gone in str(err.value)
    assert "expert.layers.2.post_attention_layernorm.dense.weight" in str(err.value)


def test_missing_embedding_and_head_is_named(tmp_path, source):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path, head="embed")
    rewrite(path, lambda t: t.pop(EMBED))
    with pytest.raises(ValueError, match="missing") as err:
        load_pi05_checkpoint(fresh(), path)
    assert EMBED in str(err.value) and "or the tied" in str(err.value)


def test_mis_shaped_tensor_is_named(tmp_path, source):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path)
    key = f"model.{P}.paligemma.model.language_model.layers.1.mlp.down_proj.weight"
    rewrite(path, lambda t: t.update({key: torch.zeros(128, 100)}))
    model = fresh()
    before = weights_digest(model)
    with pytest.raises(ValueError, match="1 mis-shaped") as err:
        load_pi05_checkpoint(model, path)
    assert f"{key}: file (128, 100) vs model (128, 384)" in str(err.value)
    assert weights_digest(model) == before  # checked before any tensor is copied


def test_unknown_tensor_is_named(tmp_path, source):
    path = tmp_path / "model.safetensors"
    save_in_lerobot_layout(source, path, extra={"model.some_new_head.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="1 unexpected.*model.some_new_head.weight"):
        load_pi05_checkpoint(fresh(), path)


def test_only_safetensors_are_read(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"not a pickle either")
    with pytest.raises(ValueError, match="only .safetensors"):
        load_pi05_checkpoint(fresh(), bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_pi05_checkpoint(fresh(), tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_pi05_checkpoint(fresh(), tmp_path)


def test_own_layout_round_trip(tmp_path, source, source_chunk):
    path = tmp_path / "own.safetensors"
    save_weights(source, path)
    model = fresh()  # another seed, same shapes: seed is part of the config
    with pytest.raises(ValueError, match="another model config"):
        load_weights(model, path)
    model = build_model(get_preset("tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_weights(model, path)
    assert_same_weights(model, source)
    assert torch.equal(action_chunk(model), source_chunk)


def test_own_layout_refuses_another_config(tmp_path, source):
    path = tmp_path / "own.safetensors"
    save_weights(source, path)
    other = build_model(get_preset("tiny", action_horizon=5))
    with pytest.raises(ValueError, match="another model config"):
        load_weights(other, path)
    lerobot = tmp_path / "lerobot.safetensors"
    save_in_lerobot_layout(source, lerobot)
    with pytest.raises(ValueError, match="not an embodied_kv weights file"):
        load_weights(source, lerobot)


def test_the_peer_loads_the_tensors_a_lerobot_file_holds(tiny_model, tmp_path):
    """LeRobot's load_state_dict gets exactly the tensors of the LeRobot-layout file."""
    state = lerobot_state_dict(tiny_model)
    save_in_lerobot_layout(tiny_model, tmp_path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert state.keys() == saved.keys() == set(lerobot_key_map(tiny_model.cfg).values())
    assert all(torch.equal(state[k], saved[k]) for k in state)
