"""Gemma building blocks: RMSNorm (plain and adaptive), gated GELU-tanh MLP, RoPE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from embodied_kv.kernels.gelu_gate import gelu_gate
from embodied_kv.kernels.rms_norm import rms_norm
from embodied_kv.kernels.rope import rope as rope_rotate
from embodied_kv.kernels.rope import rope_pair
from embodied_kv.model.config import GemmaConfig


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., W] -> normed [..., W], one fused kernel on CUDA (kernels/rms_norm.py)."""
        return rms_norm(x, self.weight, self.eps, add_one=True)


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: a dense layer of the time condition gives scale,
    shift and the gate of the residual that follows (openpi gemma.RMSNorm with cond).

    The condition depends only on the flow time, so the action expert computes every
    norm's modulation for all Euler steps at once (`modulation` over [S, W]) and each
    step only applies it (`modulate`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(dim, 3 * dim)  # [3*W, W]: scale, shift, gate

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., W], cond [W] -> (normed [..., W], gate [W])."""
        scale1, shift, gate = self.modulation(cond)
        return self.modulate(x, scale1, shift), gate.to(x.dtype)

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cond [..., W] -> (1 + scale, shift, gate), each [..., W] fp32."""
        w = self.dense.weight  # fp32 under the precision policy, like the condition
        scale, shift, gate = self.dense(cond.to(w.dtype)).float().chunk(3, dim=-1)
        return 1.0 + scale, shift, gate

    def modulate(self, x: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """x [..., W] normalised in fp32, then x * (1 + scale) + shift, in x's dtype; one
        fused kernel on CUDA. scale1, shift [W] fp32."""
        return rms_norm(x, scale1, self.eps, shift)


class GatedMLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)
        self.fusion = None  # model/fused.py: gate/up as one GEMM (CUDA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, W] -> [N, W]; GELU and the product are one kernel on CUDA."""
        return F.linear(self.activation(x), self.down_proj.weight)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, W] -> gelu(gate) * up [N, hidden]: the MLP before its down projection."""
        if self.fusion is not None and self.fusion.usable():
            gate, up = self.fusion.split(x)
        else:
            gate, up = F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)
        return gelu_gate(gate, up)


class Attention(nn.Module):
    """Q/K/V/O projections of one layer (the attention itself is done by the caller,
    because the backbone reads the arena and the expert reads prefix + suffix).

    The projections (and GatedMLP's) are nn.Linear for the checkpoints' names, but the hot
    path calls F.linear on their weights: the same op without nn.Module's call machinery,
    ~2 us each on a 2-core CPU, 29 per decode step of the tiny backbone (4 layers + LM head)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.fusion = None  # model/fused.py: q/k/v as one GEMM (CUDA)

    def qkv(
        self, x: torch.Tensor, fused: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, W] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]; fused=False: three GEMMs
        even where model/fused.py set up one (a baseline that runs as LeRobot does)."""
        n = x.shape[0]
        if fused and self.fusion is not None and self.fusion.usable():
            q, k, v = self.fusion.split(x)
        else:
            q = F.linear(x, self.q_proj.weight)
            k = F.linear(x, self.k_proj.weight)
            v = F.linear(x, self.v_proj.weight)
        shape = (n, self.kv_heads, self.head_dim)
        return q.view(n, self.heads, self.head_dim), k.view(shape), v.view(shape)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output [N, Hq * D] -> [N, W]."""
        return F.linear(o, self.o_proj.weight)


class GemmaLayer(nn.Module):
    """The parameters of one transformer layer (names as in the checkpoints). The
    backbone's norms are plain RMSNorm; the action expert's are adaptive."""

    def __init__(self, cfg: GemmaConfig, adaptive: bool):
        super().__init__()
        norm = AdaRMSNorm if adaptive else RMSNorm
        self.input_layernorm = norm(cfg.width, cfg.rms_eps)
        self.self_attn = Attention(cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim)
        self.post_attention_layernorm = norm(cfg.width, cfg.rms_eps)
        self.mlp = GatedMLP(cfg.width, cfg.mlp)


class Rope(nn.Module):
    """Rotary embedding in HF's half-split layout (the checkpoints' q/k layout).

    The tables are stored full width, cos as [cos, cos] and sin as [-sin, sin], so a
    rotation is x * cos + swap_halves(x) * sin: one kernel on CUDA, 6 torch ops on the CPU
    instead of 11, and the same bytes as x1 cos - x2 sin | x2 cos + x1 sin (negation and
    a + (-b) are exact).
    They stay fp32 whatever the model dtype: call `reset_tables` after `.to()`."""

    def __init__(self, head_dim: int, max_pos: int, theta: float):
        super().__init__()
        self.head_dim, self.max_pos, self.theta = head_dim, max_pos, theta
        self.register_buffer("cos", torch.empty(max_pos, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_pos, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        d = self.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(self.max_pos, dtype=torch.float64)[:, None] * inv[None]  # [P, D/2]
        cos, sin = ang.cos(), ang.sin()
        dev = self.cos.device
        # float64 until the last cast: the only fp32 bytes allocated are the tables
        self.cos = torch.cat([cos, cos], dim=-1).float().to(dev)  # [P, D]
        self.sin = torch.cat([-sin, sin], dim=-1).float().to(dev)

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """x [N, H, D], position [N] -> x rotated, same dtype."""
        return self.rotate(x, self.at(position))

    def at(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] of `position` [N]: gathered once per step, used by every layer."""
        return self.cos[position][:, None, :], self.sin[position][:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, H, D] rotated by `at`'s tables, same dtype; one kernel on CUDA
        (kernels/rope.py)."""
        return rope_rotate(x, *cos_sin)

    @staticmethod
    def rotate_pair(
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotate` of q and of k; one kernel on CUDA where they are adjacent heads of the
        fused q/k/v output (kernels/rope.py rope_pair: q, k then strided views)."""
        return rope_pair(q, k, *cos_sin)


def sinusoidal_time(
    t: torch.Tensor, dim: int, min_period: float, max_period: float
) -> torch.Tensor:
    """openpi's posemb_sincos: t [B] in [0, 1] -> [B, dim]."""
    if dim % 2:
        raise ValueError(f"time embedding dim {dim} must be even")
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    ang = t.double()[:, None] * (1.0 / period)[None] * 2 * math.pi
    return torch.cat([ang.sin(), ang.cos()], dim=-1).float()
