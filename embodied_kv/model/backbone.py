"""The Gemma backbone over the arena: every call is one packed step.

Inside a CUDA graph (engine/graphs.py) the step's plan carries device tensors only
(`runs` and `kv_len_host` are None): a host value read at capture would be frozen for
every replay. Attention then goes through `graph_attention`, one opaque op that reads
slot and kv_len where they live (the Triton kernel on CUDA; the reference in CPU
emulation, where it stands for the kernel launch).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from embodied_kv.kernels.gated_rms_norm import add_rms_norm
from embodied_kv.kernels.packed_attention import (
    RefPlan,
    packed_attention,
    plan_ref,
)
from embodied_kv.kernels.rope_store import rope_store
from embodied_kv.model.config import GemmaConfig
from embodied_kv.model.layers import GemmaLayer, RMSNorm, Rope
from embodied_kv.storage.arena import KVArena
from embodied_kv.storage.step import PackedStep


class GemmaBackbone(nn.Module):
    def __init__(self, cfg: GemmaConfig, vocab_size: int, max_pos: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, adaptive=False) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.width, cfg.rms_eps)
        self.rope = Rope(cfg.head_dim, max_pos, cfg.rope_theta)
        self.scale = cfg.head_dim**-0.5
        # RoPE with the K/V store, and the residual adds with the norms after them, one
        # kernel each on CUDA; False: the ops apart (bench latency's graphs_prev)
        self.fused_epilogues = True

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [N] -> [N, W], scaled by sqrt(width) (Gemma)."""
        e = self.embed_tokens(ids)
        return e * embed_scale(self.cfg.width, e.dtype)

    def forward(
        self, x: torch.Tensor, step: PackedStep, arena: KVArena, observer=None
    ) -> torch.Tensor:
        """x [Np, W] embeddings laid out as `step` says -> final-normed hidden [Np, W].

        Writes every token's K/V into its arena row; reads what kv_len allows.
        `observer(layer, q [Np, Hq, D] after RoPE, k_cache [S, T, Hkv, D])` is called once
        per layer after the layer's K/V are written (VL-Cache's statistics, kv/compress.py)."""
        assert x.shape[0] == step.n_padded
        cos_sin = self.rope.at(step.position)
        plans = self._ref_plans(step, arena) if step.runs is not None and not x.is_cuda else None
        xn, last = self.layers[0].input_layernorm(x), len(self.layers) - 1
        for i in range(len(self.layers)):
            plan = None if plans is None else plans[i]
            after = self.norm if i == last else self.layers[i + 1].input_layernorm
            x, _, xn = self._layer(i, x, xn, cos_sin, step, arena, observer, plan, after)
        return xn

    def layer_forward(
        self,
        i: int,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        step: PackedStep,
        arena: KVArena,
        observer=None,
        plan: RefPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i of a packed step: x [Np, W] -> (x [Np, W], q [Np, Hq, D] after RoPE).

        Writes the tokens' K/V into their rows of layer i first. The selective prefill of
        planner memory (kv/recompute.py) runs layers one by one on shrinking token sets
        through this same function, so its full-set case is this forward in bytes. `plan`:
        the reference attention's plan for this layer's lengths (`_ref_plans`); without it
        the reference makes its own (same bytes)."""
        x, q, _ = self._layer(i, x, None, cos_sin, step, arena, observer, plan, None)
        return x, q

    def _layer(self, i, x, xn, cos_sin, step, arena, observer, plan, after):
        """`layer_forward` -> (x, q, after(x) or None). `xn`: the layer's input norm of x where
        the previous layer's closing kernel computed it; `after`: the RMSNorm that follows
        (the next layer's input norm or the final one), which on CUDA runs in one kernel
        with the residual add before it, as the post-attention norm does with its add
        (kernels/gated_rms_norm.py add_rms_norm); on the CPU the same ops one by one."""
        layer = self.layers[i]
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x) if xn is None else xn)
        k_cache, v_cache = arena.k[i], arena.v[i]
        row, kv_len = step.row[i], step.kv_len[i]
        # RoPE on q and k, then k and v into their arena rows: one kernel on CUDA
        fused = self.fused_epilogues
        q = rope_store(q, k, v, *cos_sin, k_cache, v_cache, step.slot, row, fused)
        if observer is not None:  # VL-Cache statistics (kv/compress.py)
            observer(i, q, k_cache)
        if step.runs is None:
            o = graph_attention(q, k_cache, v_cache, step.slot, kv_len, self.scale)
        else:  # the reference (CPU) takes a plan; the kernels need no host metadata
            o = packed_attention(
                q,
                k_cache,
                v_cache,
                step.slot,
                kv_len,
                self.scale,
                step.runs,
                step.kv_len_host[i],
                plan=plan,
            )
        post = layer.post_attention_layernorm
        y = attn.project_out(o.reshape(x.shape[0], -1))
        x, xn = add_rms_norm(x, y, post.weight, post.eps, fused)
        y = layer.mlp(xn)
        if after is None:
            return x + y, q, None
        x, xn = add_rms_norm(x, y, after.weight, after.eps, fused)
        return x, q, xn

    def _ref_plans(self, step: PackedStep, arena: KVArena) -> list[RefPlan]:
        """The reference attention's plan per layer, made once per distinct kv_len row: every
        layer shares one unless a compressed slot keeps different rows per layer."""
        made: dict[tuple[int, ...], RefPlan] = {}
        plans = []
        group = self.cfg.heads // self.cfg.kv_heads
        for i, lens in enumerate(step.kv_len_host.tolist()):
            key = tuple(lens)
            if key not in made:
                made[key] = plan_ref(
                    step.runs, step.kv_len[i], step.kv_len_host[i], group, arena.spec.max_len
                )
            plans.append(made[key])
        return plans

    def logits(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Tied LM head on the rows `index` ([R] int64, on hidden's device) of hidden
        [Np, W] -> [R, V] fp32.

        The caller keeps R fixed (storage/step.py `logit_rows`, a ROW_BUCKET multiple), so a
        row's logits do not depend on how many others are computed with it. The same as
        `head(head_rows(hidden, index))`, which callers may run apart (model/lazy_logits.py)."""
        return self.head(self.head_rows(hidden, index))

    def head_rows(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows `index` [R] of hidden [Np, W] -> [R, W]: what the LM head reads."""
        return hidden.index_select(0, index)

    def head(self, rows: torch.Tensor) -> torch.Tensor:
        """Tied LM head: rows [R, W] -> logits [R, V] fp32."""
        return (rows @ self.embed_tokens.weight.t()).float()


@functools.cache
def embed_scale(width: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(width) as a 0-dim CPU tensor of the embeddings' dtype (HF Gemma's normalizer: rounded
    to that dtype first), made once: never modified, only multiplied by."""
    return torch.tensor(math.sqrt(width), dtype=dtype)


@torch.library.custom_op("embodied_kv::graph_attention", mutates_args=())
def graph_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`packed_attention` with no host metadata: q [N, Hq, D] -> [N, Hq, D]."""
    return packed_attention(q, k_cache, v_cache, slot, kv_len, scale)


@graph_attention.register_fake
def _(q, k_cache, v_cache, slot, kv_len, scale):
    return torch.empty_like(q)
