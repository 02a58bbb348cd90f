"""The bf16 precision policy (openpi / LeRobot): who stays fp32, no fp32 spike at build,
an fp32 flow state, and a weights identity that does not read the weights."""

import json
import os

import pytest
import torch

import embodied_kv.model.expert as expert_module
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import (
    file_sha256,
    load_weights,
    save_weights,
    weights_digest,
    weights_identity,
)

FP32_GROUPS = (
    "vision.tower.embeddings.",  # openpi: patch and position embeddings
    "expert.action_in_proj.",
    "expert.action_out_proj.",
    "expert.time_mlp",
)


def is_norm(name: str) -> bool:
    """The Gemma norms (RMSNorm, adaptive RMSNorm's dense layers); not SigLIP's."""
    gemma = name.startswith(("backbone.", "expert."))
    return gemma and ("layernorm" in name or name.startswith(("backbone.norm.", "expert.norm.")))


@pytest.fixture(scope="module")
def bf16_model():
    return build_model(get_preset("tiny"), "cpu", dtype=torch.bfloat16)


def test_parameter_groups_get_the_policy_dtypes(bf16_model):
    fp32, bf16 = [], []
    for name, p in bf16_model.named_parameters():
        (fp32 if name.startswith(FP32_GROUPS) or is_norm(name) else bf16).append(name)
        want = torch.float32 if name in fp32 else torch.bfloat16
        assert p.dtype == want, name
    assert "vision.tower.embeddings.patch_embedding.weight" in fp32
    assert "vision.tower.embeddings.position_embedding.weight" in fp32
    assert "vision.tower.encoder.layers.0.mlp.fc1.weight" in bf16
    assert "vision.projector.weight" in bf16
    assert "expert.layers.0.input_layernorm.dense.weight" in fp32  # adaRMS dense
    assert "backbone.layers.0.post_attention_layernorm.weight" in fp32
    assert "backbone.embed_tokens.weight" in bf16  # = the tied LM head
    assert "expert.layers.0.mlp.down_proj.weight" in bf16
    assert "backbone.layers.0.self_attn.q_proj.weight" in bf16
    assert bf16_model.backbone.rope.cos.dtype == torch.float32
    assert bf16_model.arena_spec(2, 256).dtype == torch.bfloat16


def test_fp32_build_is_all_fp32(tiny_model):
    assert {p.dtype for p in tiny_model.parameters()} == {torch.float32}


def test_build_allocates_every_parameter_once_in_its_own_dtype(count_allocations):
    """No parameter is created in fp32 and then cast: the bf16 bytes allocated while
    building are exactly the bf16 parameters, and fp32 allocations are the fp32 groups
    plus the RoPE tables (built twice: placeholder, then the table)."""
    with count_allocations() as c:
        m = build_model(get_preset("tiny"), "cpu", dtype=torch.bfloat16)
    params = {dt: 0 for dt in (torch.float32, torch.bfloat16)}
    for p in m.parameters():
        params[p.dtype] += p.numel() * p.element_size()
    buffers = sum(b.numel() * b.element_size() for b in m.buffers() if b.dtype == torch.float32)
    assert c.bytes[torch.bfloat16] == params[torch.bfloat16]
    assert params[torch.float32] <= c.bytes[torch.float32] <= params[torch.float32] + 2 * buffers


def test_euler_state_is_fp32_between_steps(bf16_model, monkeypatch):
    """The state fed to each velocity is fp32 and holds values bf16 cannot represent:
    it is not rounded to the model dtype between Euler steps."""
    m = bf16_model
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    prefix = m.embed_prefix(synthetic_observation(m.cfg, 3, "stack the cups"))
    m.prefill(arena, slot, prefix)
    states = []
    action_in = expert_module.action_in  # the in-projection (kernels/flow_io.py) takes x_t

    def recorded(x_t, *args):
        states.append(x_t.clone())
        return action_in(x_t, *args)

    monkeypatch.setattr(expert_module, "action_in", recorded)
    chunk = m.sample_actions(arena, slot, arena.slot_len(slot), m.make_noise(5))
    assert len(states) == m.cfg.denoise_steps
    assert chunk.dtype == torch.float32 and torch.isfinite(chunk).all()
    for x in states:
        assert x.dtype == torch.float32
        assert (x != x.to(torch.bfloat16).float()).any()
    assert not torch.equal(states[-1], states[0])


def test_identity_of_random_weights_is_preset_seed_dtype(tiny_model, bf16_model):
    same = build_model(get_preset("tiny"))
    assert weights_identity(same) == weights_identity(tiny_model) == tiny_model.weights_id
    other_seed = build_model(get_preset("tiny", seed=1))
    ids = {weights_identity(m) for m in (tiny_model, other_seed, bf16_model)}
    assert len(ids) == 3


def test_identity_of_loaded_weights_hashes_the_file_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBODIED_KV_CACHE_DIR", str(tmp_path / "cache"))
    src = build_model(get_preset("tiny"))
    with torch.no_grad():
        src.backbone.norm.weight.add_(0.5)  # trained weights: not what the seed gives
    path = tmp_path / "w.safetensors"
    save_weights(src, path)
    a = build_model(get_preset("tiny"))
    load_weights(a, path)
    assert weights_digest(a) == weights_digest(src)
    assert weights_identity(a) != weights_identity(build_model(get_preset("tiny")))
    cache = tmp_path / "cache" / "weights_digests.json"
    assert cache.is_file() and not list(cache.parent.glob(".*.tmp"))  # written atomically
    # the second start takes the digest from the cache (size + mtime unchanged) ...
    known = json.loads(cache.read_text())
    (key,) = known
    cache.write_text(json.dumps({key: "0" * 64}))
    assert file_sha256(path) == "0" * 64
    b = build_model(get_preset("tiny"))
    load_weights(b, path)
    assert b.weights_id != a.weights_id  # (it came from the planted cache entry)
    # ... and a changed file is hashed again
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    c = build_model(get_preset("tiny"))
    load_weights(c, path)
    assert c.weights_id == a.weights_id
