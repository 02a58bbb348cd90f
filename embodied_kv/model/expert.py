"""The action expert: flow matching over the backbone's prefix KV (pi0.5).

Its queries (the noisy action chunk) attend, layer by layer, to the prefix slot's
arena rows plus their own transient K/V; they never write the arena.

    prefix rows  [0, P)        read from arena.k[l][slot], arena.v[l][slot]
    suffix       P .. P+H-1    positions of the H action tokens, bidirectional
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from embodied_kv.kernels.flow_io import action_in, euler_out
from embodied_kv.kernels.triton_base import as_dtype
from embodied_kv.model.config import ModelConfig
from embodied_kv.model.expert_step import (
    StepInputs,
    WorkspaceCache,
    fused_ready,
    layer_step_fused,
    layer_step_persistent,
    layer_step_ref,
    layers_step_persistent,
)
from embodied_kv.model.flow_constants import FlowModulationCache
from embodied_kv.model.layers import AdaRMSNorm, GemmaLayer, Rope, sinusoidal_time
from embodied_kv.model.weight_prefetch import PREFETCH, StepPrefetch
from embodied_kv.storage.arena import KVArena

# The expert's layer-step on CUDA: the chain (cuBLAS GEMMs over the fused q/k/v and gate/up
# weights, the norm / RoPE / GELU-gate kernels, the split attention) or the five fused
# kernels of model/expert_step.py. An H200 ran the chain faster (bench latency --quick, pi05,
# 2 cameras, 2026-12-04): 20.11 ms an action against 21.39 ms fused with the tiles tuned
# (bench/kernel_sweep.py), 25.23 against 29.97 ms before. `bench latency` times the other
# beside it (`graphs_fused_ms` / `graphs_unfused_ms`) and says LOSS if the default loses.
FUSED_LAYER_STEP = False
# The fused layer-step as one persistent launch (kernels/expert_layer_step.py) rather than
# five: untimed on a GPU; `bench latency`'s fused row times whichever this says.
PERSISTENT_LAYER_STEP = True
# and with it, all the layers of an Euler step in one launch (issue 33 item 1, stage 2;
# untimed): 10 launches a denoise instead of 180. Without the host's weight prefetch between
# layers (model/weight_prefetch.py hooks the launches it sees).
PERSISTENT_EULER_STEP = True


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
        self.flow_mods = FlowModulationCache()  # model/flow_constants.py: once per weights
        self.workspaces = WorkspaceCache()  # split-K buffers of the layer-step (CUDA)
        # True: CUDA runs the five fused kernels (model/expert_step.py); False: the chain
        self.fused_layer_step = FUSED_LAYER_STEP
        self.persistent_layer_step = PERSISTENT_LAYER_STEP  # the fused path in one launch
        self.persistent_euler_step = PERSISTENT_EULER_STEP  # ... a launch per Euler step
        # the chain's attention rotates q and k itself (kernels/expert_attention.py rope=);
        # False: a RoPE launch before it (bench latency's graphs_prev)
        self.rope_in_attention = True
        # each GEMM's weights into L2 while the one before runs (model/weight_prefetch.py)
        self.prefetch_weights = PREFETCH
        self.prefetch_log: list | None = None  # a list: what would be prefetched (tests)
        self._prefetch_stream = None  # the side stream, made on the first CUDA sample

    @property
    def dtype(self) -> torch.dtype:
        """The residual stream's dtype (the projections'); heads and norms may be fp32."""
        return self.layers[0].self_attn.q_proj.weight.dtype

    def time_cond(self, t: torch.Tensor) -> torch.Tensor:
        """Flow time t [] -> adaRMS condition [W]."""
        return self.time_conds(t.reshape(1))[0]

    def time_conds(self, times: torch.Tensor) -> torch.Tensor:
        """Flow times [S] -> adaRMS conditions [S, W] (fp32 under the precision policy)."""
        c = self.cfg
        emb = sinusoidal_time(times, c.expert.width, c.time_min_period, c.time_max_period)
        emb = emb.to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def norms(self) -> list[AdaRMSNorm]:
        """Every adaptive norm in the order `velocity` applies them: per layer input and
        post-attention, then the final norm (2 x layers + 1)."""
        out = []
        for layer in self.layers:
            out += [layer.input_layernorm, layer.post_attention_layernorm]
        return out + [self.norm]

    def modulation(self, times: torch.Tensor) -> Modulation:
        """The adaRMS modulation of every norm at every flow time in `times` [S]: one
        GEMM [S, W] x [W, 3W] per norm, each dense weight read once per action chunk
        instead of once per Euler step (pi05: 37 x 12 MiB fp32 read 10 times otherwise).

        Equal to `AdaRMSNorm.modulation` of each step's condition up to fp32 rounding
        (a GEMM of S rows sums in another order than one of 1 row)."""
        cond = self.time_conds(times)  # [S, W]
        mods = torch.stack([n.dense(cond.to(n.dense.weight.dtype)).float() for n in self.norms()])
        scale, shift, gate = mods.chunk(3, dim=-1)  # each [N, S, W]
        return Modulation(1.0 + scale, shift, gate.to(self.dtype))

    def velocity(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
        rows: int | None = None,
    ) -> torch.Tensor:
        """x_t [H, A] at flow time t [] -> velocity [H, A] (one Euler step on its own)."""
        ctx = self.context(t.reshape(1), x_t.shape[0], prefix_len, rows, x_t.device)
        return self.velocity_at(x_t, ctx, 0, arena, slot, prefix_len)

    def flow_modulation(self, steps: int, device) -> Modulation:
        """The modulation of the `steps` Euler steps' flow times (`step_times`; `CLEAN`:
        t = 0 alone), kept per (steps, dtype, device) while the weights stay the same
        (model/flow_constants.py); the bytes `modulation(table_times(steps, device))`
        computes."""
        return self.flow_mods.get(self, steps, device)

    def context(
        self, times, h_len: int, prefix_len, rows: int | None, device, layer_rows=None,
        modulation: Modulation | None = None,
    ) -> StepContext:  # fmt: skip
        """What every Euler step shares: modulation for `times` [S] (or `modulation`, that
        of those times, given), the suffix's RoPE tables, the additive prefix mask (0 / -inf
        over [0, rows), or zeros [P]).

        `layer_rows` [L] (a VL-Cache-compressed prefix, kv/compress.py): layer l reads rows
        [0, layer_rows[l]) and the mask is per layer, [L, rows + H]."""
        position = prefix_len + torch.arange(h_len, device=device)
        n_rows = prefix_len if rows is None else rows
        lead = () if layer_rows is None else (layer_rows.shape[0],)
        valid = prefix_len if layer_rows is None else layer_rows[:, None]  # [L, 1]
        bias = torch.zeros(*lead, n_rows, device=device)
        if rows is not None:
            bias = bias.masked_fill(torch.arange(rows, device=device) >= valid, float("-inf"))
        # the suffix attends to all its own tokens: its part of the mask is zeros
        suffix = torch.zeros(*lead, h_len, device=device)
        bias = torch.cat([bias, suffix], dim=-1)  # [rows + H] or [L, rows + H] fp32
        mod = self.modulation(times) if modulation is None else modulation
        return StepContext(mod, self.rope.at(position), n_rows, bias)

    def velocity_at(
        self,
        x_t: torch.Tensor,
        ctx: StepContext,
        k: int,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
    ) -> torch.Tensor:
        """x_t [H, A] at Euler step k of `ctx` -> velocity [H, A] in the output head's dtype
        (fp32 under the precision policy; openpi casts the expert's output up before the
        head).

        With `rows` in the context, arena rows [0, rows) are read and those >= prefix_len
        (a 0-d device tensor) masked, so one CUDA graph serves every prefix length up to
        `rows`."""
        out = self.action_out_proj
        return out(as_dtype(self.hidden_at(x_t, ctx, k, arena, slot, prefix_len), out.weight.dtype))

    def hidden_at(
        self,
        x_t: torch.Tensor,
        ctx: StepContext,
        k: int,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
        prefetch: StepPrefetch | None = None,
    ) -> torch.Tensor:
        """`velocity_at` up to the output head: the final norm's [H, W], the model dtype.
        `prefetch`: sample's weight prefetch, told as each layer's GEMMs are about to run."""
        mod = ctx.modulation
        inp = self.action_in_proj  # fp32 [W, A] with its cast: one kernel on CUDA
        h = action_in(x_t, inp.weight, inp.bias, self.dtype)
        xn = None  # the chain's next input norm, from the previous layer's closing kernel
        last = len(self.layers) - 1
        one_launch = self.persistent_euler_step and self.persistent_layer_step
        if one_launch and all(self.takes_fused(mod, x, h) for x in self.layers):
            # every layer in one launch (model/expert_step.py), or layer by layer below
            inputs = [self.step_inputs(i, k, ctx, arena, slot) for i in range(last + 1)]
            out = layers_step_persistent(list(self.layers), h, inputs, self.workspaces,
                                         prefetch=self.prefetch_weights)  # fmt: skip
            if out is not None:
                return self.norm.modulate(out, mod.scale1[-1, k], mod.shift[-1, k])
        for i, layer in enumerate(self.layers):
            j = 2 * i
            inputs = self.step_inputs(i, k, ctx, arena, slot)
            hook = None if prefetch is None else partial(prefetch.at, k, i)
            persistent = self.takes_fused(mod, layer, h) and self.persistent_layer_step
            if hook is not None and not persistent:
                hook(0)  # the q/k/v GEMM is next
            # CUDA: model/expert_step.py; its kernels take one modulation row for all rows
            if persistent:  # one launch, whose items prefetch their own phase's weights
                h = layer_step_persistent(layer, h, inputs, self.workspaces,
                                          prefetch=self.prefetch_weights)  # fmt: skip
                xn = None
            elif self.takes_fused(mod, layer, h):
                h, xn = layer_step_fused(layer, h, inputs, self.workspaces, hook=hook), None
            elif i < last and self.takes_fused(mod, self.layers[i + 1], h):
                h = layer_step_ref(layer, h, inputs, xn, rope_in_attention=self.rope_in_attention,
                                   work=self.workspaces, hook=hook)  # fmt: skip
                xn = None
            else:  # the closing residual and the norm after it: one kernel on CUDA
                nxt = self.norm if i == last else self.layers[i + 1].input_layernorm
                jn = -1 if i == last else j + 2
                h, xn = layer_step_ref(layer, h, inputs, xn,
                                       (mod.scale1[jn, k], mod.shift[jn, k], nxt.eps),
                                       self.rope_in_attention, self.workspaces, hook)  # fmt: skip
        if xn is None:
            xn = self.norm.modulate(h, mod.scale1[-1, k], mod.shift[-1, k])
        return xn

    def step_inputs(self, i: int, k: int, ctx: StepContext, arena: KVArena,
                    slot: int) -> StepInputs:  # fmt: skip
        """What layer i reads at Euler step k besides the residual stream."""
        mod, j = ctx.modulation, 2 * i
        return StepInputs(
            scale1=(mod.scale1[j, k], mod.scale1[j + 1, k]),
            shift=(mod.shift[j, k], mod.shift[j + 1, k]),
            gate=(mod.gate[j, k], mod.gate[j + 1, k]),
            cos_sin=ctx.cos_sin,
            kp=arena.k[i, slot, : ctx.n_rows],  # [P, Hkv, D], a view
            vp=arena.v[i, slot, : ctx.n_rows],
            bias=ctx.bias if ctx.bias.dim() == 1 else ctx.bias[i],
            scale=self.scale,
        )

    def takes_fused(self, mod, layer, h: torch.Tensor) -> bool:
        """The layer runs the five fused kernels (CUDA, FUSED_LAYER_STEP, one modulation row
        for all rows); else the chain."""
        return self.fused_layer_step and mod.scale1.dim() == 3 and fused_ready(layer, h)

    @torch.no_grad()
    def sample(
        self,
        arena: KVArena,
        slot: int,
        prefix_len: int | torch.Tensor,
        noise: torch.Tensor,
        rows: int | None = None,
        layer_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Euler integration from t=1 (noise [H, A]) to t=0 -> action chunk [H, A] fp32.

        The flow state x stays fp32 whatever the model dtype (openpi, LeRobot). No
        host-device copies inside, so engine/graphs.py can capture it whole. What the
        steps share (RoPE tables, mask) is computed once; the modulation of the 10 flow times
        once per weights load (`flow_modulation`)."""
        steps = self.cfg.denoise_steps
        dt = -1.0 / steps
        x = noise.float()
        mod = self.flow_modulation(steps, x.device)  # of t_k = 1 + k dt, kept across actions
        ctx = self.context(None, x.shape[0], prefix_len, rows, x.device, layer_rows, mod)
        out = self.action_out_proj
        prefetch = self.step_prefetch(steps, x.device)
        for k in range(steps):  # x + dt * v, the head and its cast: one kernel on CUDA
            xn = self.hidden_at(x, ctx, k, arena, slot, prefix_len, prefetch)
            x = euler_out(x, xn, out.weight, out.bias, dt)
        prefetch.close()
        return x

    def step_prefetch(self, steps: int, device: torch.device) -> StepPrefetch:
        """The weight prefetch of one `sample` (inactive off CUDA unless prefetch_log is a
        list, or where the GPU's L2 is too small: model/weight_prefetch.py)."""
        pf = StepPrefetch(self.layers, steps, device, self.prefetch_weights, self.prefetch_log,
                          self._prefetch_stream)  # fmt: skip
        self._prefetch_stream = pf.stream
        return pf


@dataclass(frozen=True)
class Modulation:
    """adaRMS modulation of the expert's N = 2 x layers + 1 norms at S flow times; per
    action row [N, S, H, W] where rows differ in flow time (model/rtc_prefix.py)."""

    scale1: torch.Tensor  # [N, S, W] fp32: 1 + scale
    shift: torch.Tensor  # [N, S, W] fp32
    gate: torch.Tensor  # [N, S, W] in the residual stream's dtype (the last row unused)


@dataclass(frozen=True)
class StepContext:
    """What the Euler steps of one `sample` call share (built once, read by each step)."""

    modulation: Modulation
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # [H, 1, D] each: RoPE of the suffix
    n_rows: int | torch.Tensor  # prefix rows read from the arena
    bias: torch.Tensor  # [n_rows + H] fp32 additive mask: 0 or -inf (rows >= prefix_len);
    # [L, n_rows + H] for a compressed prefix (rows >= that layer's length)
