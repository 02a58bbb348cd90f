"""A differentiable, batched forward of the VLA's own modules for training.

The engine runs the same parameters through packed steps over the arena (no autograd,
one slot per sequence); this runs them densely over a padded batch with the masks the
engine's layout implies, so what is trained is what the engine computes
(test/train/test_forward.py checks logits and velocities against the engine's).

    backbone: x [B, L, W], L = I + T; prefix rows (i < P_b) attend to j < P_b;
              text rows after the prefix attend causally (j <= i); pad keys masked
    expert:   H action tokens at positions P_b .. P_b+H-1 attend to the backbone's
              rotated K/V rows j < P_b of each layer plus each other (bidirectional)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embodied_kv.model.layers import sinusoidal_time
from embodied_kv.train.batch import Batch


@dataclass
class BackboneOut:
    hidden: torch.Tensor  # [B, L, W] final-normed
    keys: list[torch.Tensor]  # per layer [B, Hkv, L, D], after RoPE (as the arena stores K)
    values: list[torch.Tensor]  # per layer [B, Hkv, L, D]
    prefix_len: torch.Tensor  # [B] P_b
    image_tokens: int  # I
    images: torch.Tensor | None = None  # [B, I, W] the projected image tokens (aux loss)
    tapped: torch.Tensor | None = None  # [B, I, W] image rows after `tap` layers (grounding)
    tapped_text: torch.Tensor | None = None  # [B, T, W] text rows after `tap` layers (names)


def backbone_forward(model, batch: Batch, tap: int = 0) -> BackboneOut:
    """`tap` > 0: also the image and text rows of the residual stream after that many
    layers."""
    bb, cfg = model.backbone, model.cfg
    b, cams = batch.images.shape[:2]
    img = model.vision(batch.images.reshape(b * cams, *batch.images.shape[2:]))
    img = img.reshape(b, -1, cfg.backbone.width)  # [B, I, W]
    n_img = img.shape[1]
    x = torch.cat([img.to(model.dtype), bb.embed(batch.ids)], dim=1)  # [B, L, W]
    seq = x.shape[1]
    pos = torch.arange(seq, device=x.device)
    prefix = n_img + batch.prompt_len  # [B]
    valid = pos[None, :] < (n_img + batch.text_len)[:, None]  # [B, L] keys
    in_prefix = pos[None, :] < prefix[:, None]  # [B, L]
    causal = pos[None, :] <= pos[:, None]  # [L(i), L(j)]
    allowed = torch.where(
        in_prefix[:, :, None], in_prefix[:, None, :], causal[None]
    ) & valid[:, None, :]  # [B, L(i), L(j)]
    tapped: list[torch.Tensor] = []
    x, keys, values = backbone_layers(bb, x, allowed, tap, tapped)
    rows, text = (tapped[0][:, :n_img], tapped[0][:, n_img:]) if tapped else (None, None)
    return BackboneOut(bb.norm(x), keys, values, prefix, n_img, img, rows, text)


def backbone_layers(
    bb, x: torch.Tensor, allowed: torch.Tensor, tap: int = 0, tapped: list | None = None
) -> tuple:
    """The backbone's decoder layers over x [B, L, W] at positions 0..L-1 with the key
    mask allowed [B, L(i), L(j)] -> (x, per-layer rotated keys, values) (also the
    text-only recall probe's forward, train/recall_probe.py); x after `tap` layers is
    appended to `tapped`."""
    if tap and not 1 <= tap <= len(bb.layers):
        raise ValueError(f"tap {tap} must be in [1, {len(bb.layers)}] (layers)")
    b, seq = x.shape[:2]
    cfg = bb.cfg
    cos_sin = bb.rope.at(torch.arange(seq, device=x.device).repeat(b))
    heads, kv_heads, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    keys, values = [], []
    for layer in bb.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x).reshape(b * seq, -1))
        q, k = bb.rope.rotate(q, cos_sin), bb.rope.rotate(k, cos_sin)
        q = q.view(b, seq, heads, d).transpose(1, 2)
        k = k.view(b, seq, kv_heads, d).transpose(1, 2)
        v = v.view(b, seq, kv_heads, d).transpose(1, 2)
        keys.append(k)
        values.append(v)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None], scale=bb.scale, enable_gqa=True
        )  # [B, Hq, L, D]
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, seq, heads * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if tapped is not None and len(keys) == tap:
            tapped.append(x)
    return x, keys, values


def text_logits(model, out: BackboneOut, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Tied-head logits [N, V] at text positions (rows [N], text index cols [N])."""
    h = out.hidden[rows, out.image_tokens + cols]
    return (h @ model.backbone.embed_tokens.weight.t()).float()


def expert_velocity(model, out: BackboneOut, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t [B, H, A] at flow times t [B] (or per row [B, H]: model/rtc_prefix.py) ->
    velocity [B, H, A] fp32."""
    ex, cfg = model.expert, model.cfg
    b, h_len, _ = x_t.shape
    e = cfg.expert
    emb = sinusoidal_time(t.reshape(-1), e.width, cfg.time_min_period, cfg.time_max_period)
    emb = emb.to(ex.time_mlp_in.weight.dtype)
    cond = F.silu(ex.time_mlp_out(F.silu(ex.time_mlp_in(emb))))
    cond = cond.view(b, h_len if t.dim() == 2 else 1, -1)  # [B, H or 1, W]
    dev = x_t.device
    position = (out.prefix_len[:, None] + torch.arange(h_len, device=dev)[None]).reshape(-1)
    cos_sin = ex.rope.at(position)
    seq = out.keys[0].shape[2]
    prefix_ok = torch.arange(seq, device=dev)[None, :] < out.prefix_len[:, None]  # [B, L]
    allowed = torch.cat([prefix_ok, torch.ones(b, h_len, dtype=torch.bool, device=dev)], dim=1)
    allowed = allowed[:, None, None, :]  # [B, 1, 1, L + H]
    h = ex.action_in_proj(x_t.to(ex.action_in_proj.weight.dtype)).to(ex.dtype)
    for i, layer in enumerate(ex.layers):
        attn = layer.self_attn
        xn, gate = layer.input_layernorm(h, cond)
        q, k, v = attn.qkv(xn.reshape(b * h_len, -1))
        q, k = ex.rope.rotate(q, cos_sin), ex.rope.rotate(k, cos_sin)
        q = q.view(b, h_len, e.heads, e.head_dim).transpose(1, 2)
        k = k.view(b, h_len, e.kv_heads, e.head_dim).transpose(1, 2)
        v = v.view(b, h_len, e.kv_heads, e.head_dim).transpose(1, 2)
        k_all = torch.cat([out.keys[i], k], dim=2)
        v_all = torch.cat([out.values[i], v], dim=2)
        o = F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=allowed, scale=ex.scale, enable_gqa=True
        )
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, h_len, -1)) * gate
        xn, gate = layer.post_attention_layernorm(h, cond)
        h = h + layer.mlp(xn) * gate
    h, _ = ex.norm(h, cond)
    return ex.action_out_proj(h.to(ex.action_out_proj.weight.dtype)).float()
