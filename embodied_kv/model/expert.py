"""The action expert: flow matching over the backbone's prefix KV (pi0.5).

Its queries (the noisy action chunk) attend, layer by layer, to the prefix slot's
arena rows plus their own transient K/V; they never write the arena.

    prefix rows  [0, P)        read from arena.k[l][slot], arena.v[l][slot]
    suffix       P .. P+H-1    positions of the H action tokens, bidirectional
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embodied_kv.kv.arena import KVArena
from embodied_kv.model.config import ModelConfig
from embodied_kv.model.layers import AdaRMSNorm, GemmaLayer, Rope, sinusoidal_time


class ActionExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int):
        super().__init__()
        e = cfg.expert
        self.cfg = cfg
        self.layers = nn.ModuleList(GemmaLayer(e, adaptive=True) for _ in range(e.layers))
        self.norm = AdaRMSNorm(e.width, e.rms_eps)
        self.rope = Rope(e.head_dim, max_pos, e.rope_theta)
        self.action_in_proj = nn.Linear(cfg.action_dim, e.width)
        self.action_out_proj = nn.Linear(e.width, cfg.action_dim)
        self.time_mlp_in = nn.Linear(e.width, e.width)
        self.time_mlp_out = nn.Linear(e.width, e.width)
        self.scale = e.head_dim**-0.5

    @property
    def dtype(self) -> torch.dtype:
        """The residual stream's dtype (the projections'); heads and norms may be fp32."""
        return self.layers[0].self_attn.q_proj.weight.dtype

    def time_cond(self, t: torch.Tensor) -> torch.Tensor:
        """Flow time t [] -> adaRMS condition [W]."""
        c = self.cfg
        emb = sinusoidal_time(t.reshape(1), c.expert.width, c.time_min_period, c.time_max_period)
        emb = emb.to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))[0]

    def velocity(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
        rows: int | None = None,
    ) -> torch.Tensor:
        """x_t [H, A] at flow time t -> velocity [H, A] in the output head's dtype (fp32
        under the precision policy; openpi casts the expert's output up before the head).

        `rows`: read arena rows [0, rows) and mask those >= prefix_len (a 0-d device
        tensor), so one CUDA graph serves every prefix length up to `rows`."""
        h_len = x_t.shape[0]
        cond = self.time_cond(t)
        position = prefix_len + torch.arange(h_len, device=x_t.device)
        n_rows = prefix_len if rows is None else rows
        valid = None if rows is None else torch.arange(rows, device=x_t.device) < prefix_len
        h = self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            xn, gate = layer.input_layernorm(h, cond)
            q, k, v = attn.qkv(xn)
            q, k = self.rope(q, position), self.rope(k, position)
            kp = arena.k[i, slot, :n_rows]  # [P, Hkv, D], a view
            vp = arena.v[i, slot, :n_rows]
            o = prefix_suffix_attention(q, kp, vp, k, v, self.scale, valid)
            h = h + attn.o_proj(o.reshape(h_len, -1)) * gate
            xn, gate = layer.post_attention_layernorm(h, cond)
            h = h + layer.mlp(xn) * gate
        h, _ = self.norm(h, cond)
        return self.action_out_proj(h.to(self.action_out_proj.weight.dtype))

    @torch.no_grad()
    def sample(
        self,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
        noise: torch.Tensor,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Euler integration from t=1 (noise [H, A]) to t=0 -> action chunk [H, A] fp32.

        The flow state x stays fp32 whatever the model dtype (openpi, LeRobot). No
        host-device copies inside, so engine/graphs.py can capture it whole."""
        steps = self.cfg.denoise_steps
        dt = -1.0 / steps
        x = noise.float()
        # t_k = 1 + k dt in float64, as the Python float would be, then fp32
        times = (1.0 + torch.arange(steps, dtype=torch.float64, device=x.device) * dt).float()
        for k in range(steps):
            x = x + dt * self.velocity(x, times[k], arena, slot, prefix_len, rows).float()
        return x


def prefix_suffix_attention(q, kp, vp, ks, vs, scale: float, valid=None) -> torch.Tensor:
    """Joint softmax over prefix rows and suffix tokens, without concatenating the
    prefix (LeRobot copies it every step; here it is read in place).

    q [H, Hq, D]; kp, vp [P, Hkv, D]; ks, vs [H, Hkv, D]; valid [P] bool or None
    -> [H, Hq, D] in q.dtype."""
    h_len, hq, d = q.shape
    hkv = kp.shape[1]
    g = hq // hkv
    qf = q.float().view(h_len, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, h_len * g, d)
    sp = torch.matmul(qf, kp.float().permute(1, 2, 0)) * scale  # [Hkv, H*g, P]
    if valid is not None:
        sp = sp.masked_fill(~valid, float("-inf"))
    ss = torch.matmul(qf, ks.float().permute(1, 2, 0)) * scale  # [Hkv, H*g, H]
    p = torch.softmax(torch.cat([sp, ss], dim=-1), dim=-1)
    n_p = kp.shape[0]
    o = torch.matmul(p[..., :n_p], vp.float().permute(1, 0, 2))
    o = o + torch.matmul(p[..., n_p:], vs.float().permute(1, 0, 2))  # [Hkv, H*g, D]
    return o.view(hkv, h_len, g, d).permute(1, 0, 2, 3).reshape(h_len, hq, d).to(q.dtype)
