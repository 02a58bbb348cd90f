"""Hugging Face `transformers` models carrying this VLA's weights, and the way
LeRobot's pi05 runs the action expert over a transformers cache.

Both exist to be compared against: parity tests check the backbone against
`GemmaForCausalLM`, and `bench step` times the same work done the way users run
pi0.5 today (`generate` one request at a time; a `DynamicCache` of the prefix
cloned for every denoise step).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GemmaConfig, GemmaForCausalLM
from transformers.models.gemma.modeling_gemma import eager_attention_forward

from embodied_kv.storage.arena import KVArena

# lerobot.utils.constants.OPENPI_ATTENTION_MASK_VALUE: the additive "masked" value.
OPENPI_MASK_VALUE = -2.3819763e38


def hf_gemma_config(model, attn_implementation: str = "eager") -> GemmaConfig:
    """transformers' GemmaConfig for the VLA's backbone (tied head, GELU-tanh, MQA)."""
    b = model.cfg.backbone
    tok = model.tokenizer
    config = GemmaConfig(
        vocab_size=model.cfg.vocab_size,
        hidden_size=b.width,
        intermediate_size=b.mlp,
        num_hidden_layers=b.layers,
        num_attention_heads=b.heads,
        num_key_value_heads=b.kv_heads,
        head_dim=b.head_dim,
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=b.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": b.rope_theta},
        max_position_embeddings=model.backbone.rope.max_pos,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    config._attn_implementation = attn_implementation
    return config


@torch.no_grad()
def to_hf_gemma(model, share: bool = False, attn_implementation: str = "eager") -> GemmaForCausalLM:
    """GemmaForCausalLM with the backbone's weights, on the model's device and dtype.

    share=True makes its parameters the backbone's own tensors (no second copy of a
    2B model on the GPU; the benchmark uses it); share=False copies them."""
    config = hf_gemma_config(model, attn_implementation)
    with torch.device("meta"):
        hf = GemmaForCausalLM(config)
    state = {k: (v if share else v.clone()) for k, v in model.backbone.state_dict().items()}
    hf.model.load_state_dict(state, strict=True, assign=True)
    hf.lm_head.weight = hf.model.embed_tokens.weight
    _reset_buffers(hf, model.device)
    for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
        assert t.device.type != "meta", f"{name} was not materialised"
    hf.generation_config.eos_token_id = None  # benchmarks decode a fixed number of tokens
    hf.generation_config.pad_token_id = config.pad_token_id
    return hf.eval()


def _reset_buffers(hf: GemmaForCausalLM, device: torch.device) -> None:
    """Non-persistent buffers that stayed on the meta device (RoPE, embedding scale)."""
    rot = hf.model.rotary_emb
    inv_freq, _ = rot.compute_default_rope_parameters(hf.config)
    rot.inv_freq = inv_freq.to(device)
    rot.original_inv_freq = inv_freq.clone().to(device)
    emb = hf.model.embed_tokens
    emb.embed_scale = torch.tensor(emb.scalar_embed_scale, device=device)
    assert math.isclose(emb.scalar_embed_scale, hf.config.hidden_size**0.5)


# -- the action expert the LeRobot way ---------------------------------------------------


def arena_to_dynamic_cache(arena: KVArena, slot: int, prefix_len: int) -> DynamicCache:
    """The prefix rows of a slot as the DynamicCache a transformers prefill returns
    (a copy, [1, Hkv, P, D] per layer, K after RoPE as HF stores it)."""
    layers = []
    for i in range(arena.spec.num_layers):
        k = arena.k[i, slot, :prefix_len].transpose(0, 1).unsqueeze(0).clone()
        v = arena.v[i, slot, :prefix_len].transpose(0, 1).unsqueeze(0).clone()
        layers.append((k, v))
    return DynamicCache(layers)


def clone_cache(cache: DynamicCache) -> DynamicCache:
    """lerobot.policies.common.vla_utils.clone_past_key_values: every layer's K and V
    cloned into a fresh DynamicCache."""
    return DynamicCache([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


def separate_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """LeRobot's GemmaMLP: gate and up as two GEMMs, tanh GELU, the product, down."""
    h = F.gelu(F.linear(x, mlp.gate_proj.weight), approximate="tanh")
    return F.linear(h * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)


def _velocity_hf_style(expert, x_t, t, cache: DynamicCache, prefix_len: int) -> torch.Tensor:
    """ActionExpert.velocity, but attention as LeRobot's gemma_expert does it: the
    suffix K/V are appended to the (cloned) prefix cache with `cache.update` (a torch.cat
    of P + H rows per layer), K/V repeated to every query head, eager softmax with the
    additive 4D mask built from pad / autoregressive masks."""
    h_len = x_t.shape[0]
    e = expert.cfg.expert
    device = x_t.device
    prefix_pad = torch.ones(1, h_len, prefix_len, dtype=torch.bool, device=device)
    suffix_ar = torch.zeros(1, h_len, dtype=torch.long, device=device)
    suffix_ar[:, 0] = 1  # LeRobot embed_suffix: att_masks = [1] + [0] * (H - 1)
    cum = suffix_ar.cumsum(1)
    suffix_2d = cum[:, None, :] <= cum[:, :, None]
    full = torch.cat([prefix_pad, suffix_2d], dim=2)[:, None]  # [1, 1, H, P + H]
    mask = torch.where(full, 0.0, OPENPI_MASK_VALUE)
    shim = SimpleNamespace(num_key_value_groups=e.heads // e.kv_heads, training=False)
    cond = expert.time_cond(t)
    position = torch.arange(prefix_len, prefix_len + h_len, device=device)
    # the precision policy (model/precision.py): fp32 action projections, bf16 layers
    h = expert.action_in_proj(x_t.to(expert.action_in_proj.weight.dtype)).to(expert.dtype)
    for i, layer in enumerate(expert.layers):
        attn = layer.self_attn
        xn, gate = layer.input_layernorm(h, cond)
        q, k, v = attn.qkv(xn, fused=False)  # [H, heads, D]: three GEMMs, as LeRobot
        q, k = expert.rope(q, position), expert.rope(k, position)
        k_all, v_all = cache.update(
            k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), i
        )  # [1, Hkv, P + H, D]
        o, _ = eager_attention_forward(
            shim, q.transpose(0, 1).unsqueeze(0), k_all, v_all, mask, expert.scale
        )  # [1, H, heads, D]
        h = h + attn.o_proj(o.reshape(h_len, -1)) * gate
        xn, gate = layer.post_attention_layernorm(h, cond)
        h = h + separate_mlp(layer.mlp, xn) * gate
    h, _ = expert.norm(h, cond)
    return expert.action_out_proj(h.to(expert.action_out_proj.weight.dtype))


@torch.no_grad()
def sample_actions_hf_style(
    expert, prefix_cache: DynamicCache, prefix_len: int, noise: torch.Tensor
) -> torch.Tensor:
    """LeRobot PI05Pytorch.sample_actions after the prefix prefill: 10 Euler steps, each
    cloning the prefix DynamicCache (clone_past_key_values) before the expert appends
    its suffix to it. Same weights and Euler schedule as ActionExpert.sample."""
    steps = expert.cfg.denoise_steps
    dt = -1.0 / steps
    x = noise.to(expert.action_in_proj.weight.dtype)
    for k in range(steps):
        t = torch.tensor(1.0 + k * dt, device=x.device)
        cache = clone_cache(prefix_cache)
        x = x + dt * _velocity_hf_style(expert, x, t, cache, prefix_len)
    return x
