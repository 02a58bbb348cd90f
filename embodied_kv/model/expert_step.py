"""One layer of one Euler step of the action expert, as the GPU runs it and as the CPU does.

    reference (CPU, training, unfused weights)   fused (CUDA at inference, model/fused.py)
    adaRMS norm                                   norm_qkv_rope     kernels/norm_qkv_rope.py
    q/k/v GEMM, RoPE on q and k                   |
    attention over prefix + suffix                expert_attention  kernels/expert_attention.py
    o_proj GEMM, gated residual (addcmul)         linear_gated_residual  kernels/gemm_residual.py
    adaRMS norm, gate/up GEMM, GELU-gate          norm_gate_up      kernels/norm_gate_up.py
    down GEMM, gated residual                     linear_gated_residual

The reference is the chain the CPU's bytes are pinned to (the parity with LeRobot's PI05
rests on it); the fused path is the same arithmetic in the five kernel calls above (issue
33), each kernel tested against its reference under TRITON_INTERPRET=1, and the two paths
against each other in test/model/test_expert_step.py. `fused_ready` picks: the fused path
needs the q/k/v and gate/up fusions in use (CUDA inference) and the tensors on CUDA; and
model/expert.py FUSED_LAYER_STEP, False since an H200 measured the chain faster.

The chain as CUDA runs it: 8 kernels per layer-step (the q/k/v GEMM, the attention's
partials, which rotate q and the suffix k as they load them, and its reduce, in one
persistent launch (kernels/expert_attention.py REDUCE), o_proj, the
gated residual with the post-attention norm in one kernel (kernels/gated_rms_norm.py),
gate/up, GELU-gate, down, and the gated residual with the next norm, the next layer's input
norm or the final one, in one); on the CPU the same ops one by one, the bytes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embodied_kv.kernels import expert_attention as attention_kernels
from embodied_kv.kernels import expert_layer_step as step_kernels
from embodied_kv.kernels import gemm_residual
from embodied_kv.kernels import layer_table as layer_tables
from embodied_kv.kernels import norm_gate_up as gate_up_kernels
from embodied_kv.kernels import norm_qkv_rope as qkv_kernels
from embodied_kv.kernels.expert_attention import expert_attention, expert_workspace
from embodied_kv.kernels.expert_layer_step import StepWork
from embodied_kv.kernels.gated_rms_norm import gated_rms_norm
from embodied_kv.kernels.gemm_residual import linear_gated_residual
from embodied_kv.kernels.norm_gate_up import norm_gate_up
from embodied_kv.kernels.norm_qkv_rope import norm_qkv_rope
from embodied_kv.model.layers import GemmaLayer, Rope


@dataclass(frozen=True)
class StepInputs:
    """What one layer of one Euler step reads besides the residual stream h [H, W]."""

    scale1: tuple[torch.Tensor, torch.Tensor]  # [W] fp32 each: input norm, post-attention norm
    shift: tuple[torch.Tensor, torch.Tensor]  # [W] fp32 each
    gate: tuple[torch.Tensor, torch.Tensor]  # [W] residual dtype: after attention, after MLP
    cos_sin: tuple[torch.Tensor, torch.Tensor]  # [H, 1, D] fp32: the suffix's RoPE
    kp: torch.Tensor  # [P, Hkv, D] prefix keys of this layer (an arena view)
    vp: torch.Tensor  # [P, Hkv, D]
    bias: torch.Tensor  # [P + H] fp32 additive mask
    scale: float  # 1 / sqrt(head_dim)


def fusions_usable(layer: GemmaLayer) -> bool:
    """Both fusions of the layer are in use (inference, the parameters still view the fused
    storage: model/fused.py)."""
    a, m = layer.self_attn.fusion, layer.mlp.fusion
    return a is not None and m is not None and a.usable() and m.usable()


def fused_ready(layer: GemmaLayer, h: torch.Tensor) -> bool:
    """The five-kernel path applies: on CUDA, with both fusions usable."""
    return h.is_cuda and fusions_usable(layer)


NextNorm = tuple[torch.Tensor, torch.Tensor, float]  # scale1, shift [W] fp32; eps
Hook = Callable[[int], None]


def _no_hook(g: int) -> None:
    pass


def layer_step_ref(
    layer: GemmaLayer,
    h: torch.Tensor,
    s: StepInputs,
    xn: torch.Tensor | None = None,
    next_norm: NextNorm | None = None,
    rope_in_attention: bool = True,
    work: WorkspaceCache | None = None,
    hook: Hook | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The chain, op for op (the CPU bytes): h [H, W] -> h after the layer.

    `xn`: the layer's input norm of h where the previous layer's last kernel computed it.
    `next_norm`: the adaRMS norm that follows the layer (the next layer's input norm, or
    the expert's final one): the closing gated residual and that norm run as one kernel on
    CUDA, and the result is (h, its norm). On the CPU the same ops in the same order.
    `rope_in_attention=False`: RoPE's own launch before the attention (the chain before the
    attention rotated them: bench latency's `graphs_prev`). `work`: the caller's workspaces
    (the attention's, reused across calls on CUDA: no counters zeroed per call). `hook(g)`:
    called as GEMM g of GEMMS (1: o_proj, 2: gate/up, 3: down) is about to run (the weight
    prefetch of model/weight_prefetch.py); the caller calls it for q/k/v."""
    hook = hook or _no_hook
    attn, h_len = layer.self_attn, h.shape[0]
    if xn is None:
        xn = layer.input_layernorm.modulate(h, s.scale1[0], s.shift[0])
    q, k, v = attn.qkv(xn)
    # RoPE on q and k, then the attention: on CUDA the attention's partials and reduce, which
    # rotate q and k as they load them (the bytes of kernels/rope.py), elsewhere the same
    # ops one by one
    if not rope_in_attention:
        q, k = Rope.rotate_pair(q, k, s.cos_sin)  # one kernel on CUDA with the fused q/k/v
    rope = s.cos_sin if rope_in_attention else None
    att_work = work.attention(q, s.kp) if work is not None else None
    o = expert_attention(q, s.kp, s.vp, k, v, s.scale, s.bias, att_work, rope=rope)
    hook(1)
    # addcmul, then the post-attention norm: one kernel on CUDA (kernels/gated_rms_norm.py)
    h, xn = gated_rms_norm(h, attn.o_proj(o.reshape(h_len, -1)), s.gate[0], s.scale1[1],
                           s.shift[1], layer.post_attention_layernorm.eps)  # fmt: skip
    hook(2)
    a = layer.mlp.activation(xn)
    hook(3)
    y = F.linear(a, layer.mlp.down_proj.weight)
    if next_norm is None:
        return torch.addcmul(h, y, s.gate[1])
    return gated_rms_norm(h, y, s.gate[1], *next_norm)


def layer_step_persistent(
    layer: GemmaLayer,
    h: torch.Tensor,
    s: StepInputs,
    work: WorkspaceCache,
    kernels: bool = False,
    prefetch: bool = True,
) -> torch.Tensor:
    """The five kernels' work as one persistent launch (kernels/expert_layer_step.py), with
    the five calls' bytes; where its kernel does not run (a CPU, or a Triton that cannot
    build it), the five calls. `kernels=True` calls the Triton kernel whatever the device
    (CPU tensors under TRITON_INTERPRET=1: the tests). `prefetch`: the launch's items start
    their phase's weights towards L2 before they wait (kernels/l2_prefetch.py
    prefetch_share; CUDA only)."""
    out = _persistent_launch(layer, h, s, work, kernels, prefetch)
    return layer_step_fused(layer, h, s, work) if out is None else out


def _persistent_launch(layer, h, s, work, kernels, prefetch, table=None) -> torch.Tensor | None:
    """The persistent kernel over layer (the first of `table`'s layers) -> h after it (after
    the table's last); None where the dispatcher declines (a CPU, a Triton that cannot build
    it). `kernels=True`: the kernel itself, whatever the device."""
    attn, mlp = layer.self_attn, layer.mlp
    heads = (attn.heads, attn.kv_heads, attn.head_dim)
    args = (h, s.scale1, s.shift, (layer.input_layernorm.eps, layer.post_attention_layernorm.eps),
            s.gate, attn.fusion.weight, heads, *s.cos_sin, s.kp, s.vp, s.bias, s.scale,
            attn.o_proj.weight, mlp.fusion.weight, mlp.down_proj.weight)  # fmt: skip
    if kernels:
        return step_kernels.expert_layer_step_kernel(*args, table=table, prefetch=prefetch)
    return step_kernels.expert_layer_step(*args, work.step(h, attn, mlp, heads, s.kp), table,
                                          prefetch)  # fmt: skip


def layers_step_persistent(
    layers: list[GemmaLayer],
    h: torch.Tensor,
    inputs: list[StepInputs],
    work: WorkspaceCache,
    kernels: bool = False,
    prefetch: bool = True,
) -> torch.Tensor | None:
    """Every layer of an Euler step as one persistent launch (kernels/expert_layer_step.py
    with a LayerTable: issue 33 item 1, its second stage), with the bytes of one launch a
    layer -> h after the last layer; None where the layers cannot share a launch (weights
    or views at uneven strides, norms with different eps, a CPU, a Triton that cannot build
    it): the caller then runs them one by one. `kernels=True`: the Triton kernel whatever
    the device (the tests, under TRITON_INTERPRET=1). `prefetch`: as layer_step_persistent's."""
    eps = {(x.input_layernorm.eps, x.post_attention_layernorm.eps) for x in layers}
    if len(eps) != 1 or not (kernels or h.is_cuda):  # the launch takes layer 0's
        return None
    table = work.layer_table(layers, inputs)
    if table is None:
        return None
    return _persistent_launch(layers[0], h, inputs[0], work, kernels, prefetch, table)


def layer_step_fused(
    layer: GemmaLayer,
    h: torch.Tensor,
    s: StepInputs,
    work: WorkspaceCache,
    kernels: bool = False,
    hook: Hook | None = None,
) -> torch.Tensor:
    """The five kernel calls over the fused weights. `kernels=True` calls the Triton kernels
    whatever the device (CPU tensors under TRITON_INTERPRET=1: how the tests run this path);
    else each call dispatches (kernel on CUDA, reference elsewhere). `hook`: as
    layer_step_ref's."""
    hook = hook or _no_hook
    attn, mlp, h_len = layer.self_attn, layer.mlp, h.shape[0]
    qkv_op = qkv_kernels.norm_qkv_rope_kernel if kernels else norm_qkv_rope
    gate_up_op = gate_up_kernels.norm_gate_up_kernel if kernels else norm_gate_up
    attn_op = attention_kernels.expert_attention_kernel if kernels else expert_attention
    residual_op = gemm_residual.linear_gated_residual_kernel if kernels else linear_gated_residual
    fusion = attn.fusion
    q, k, v = qkv_op(h, s.scale1[0], s.shift[0], layer.input_layernorm.eps, fusion.weight,
                     fusion.sizes, *s.cos_sin)  # fmt: skip
    o = attn_op(q, s.kp, s.vp, k, v, s.scale, s.bias, work.attention(q, s.kp)).reshape(h_len, -1)
    w_o = attn.o_proj.weight
    hook(1)
    h = residual_op(h, o, w_o, s.gate[0], work.get(h, w_o))
    hidden = mlp.fusion.sizes[0]
    hook(2)
    a = gate_up_op(h, s.scale1[1], s.shift[1], layer.post_attention_layernorm.eps,
                   mlp.fusion.weight, hidden)  # fmt: skip
    w_down = mlp.down_proj.weight
    hook(3)
    return residual_op(h, a, w_down, s.gate[1], work.get(h, w_down))


class WorkspaceCache:
    """The gated-residual GEMM's split-K workspace (fp32 partials + per-tile counters that
    the kernel resets itself), one per (rows, width, K, dtype, device), and the expert
    attention's (its split partials and counters, kernels/expert_attention.py), one per
    shape, each allocated once: allocated before a CUDA graph's capture it is a static buffer
    of the graph; a call per layer reuses it in stream order. (A workspace per call zeroed its
    counters: a fill kernel per layer-step, 180 an action in the H200's profile.)"""

    def __init__(self) -> None:
        self._work: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._attention: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._steps: dict[tuple, StepWork] = {}
        self._offsets: dict[tuple, torch.Tensor | None] = {}  # per set of layer weights

    def step(self, h, attn, mlp, heads: tuple[int, int, int], kp) -> StepWork | None:
        """The persistent layer-step's buffers for these shapes on CUDA; None elsewhere."""
        if not h.is_cuda:
            return None
        key = (*h.shape, *heads, mlp.down_proj.weight.shape[1], kp.shape[0], h.dtype, h.device)
        if key not in self._steps:
            self._steps[key] = StepWork.new(h, attn.fusion.weight, attn.o_proj.weight,
                                            mlp.down_proj.weight, heads, kp.shape[0])  # fmt: skip
        return self._steps[key]

    def layer_table(self, layers: list[GemmaLayer], inputs: list[StepInputs]):
        """The LayerTable of one launch over `layers` (kernels/expert_layer_step.py), or None
        where they cannot share one. Its weight offsets are made on the device once per set
        of weights and kept (a CUDA graph reads them: made during warmup, never inside a
        capture); the strides of the modulation, K/V and mask are read per call."""
        weights = [(x.self_attn.fusion.weight, x.self_attn.o_proj.weight, x.mlp.fusion.weight,
                    x.mlp.down_proj.weight) for x in layers]  # fmt: skip
        key = tuple(t.data_ptr() for w in weights for t in w)
        if key not in self._offsets:
            offsets = layer_tables.weight_offsets(weights)
            device = weights[0][0].device
            self._offsets[key] = None if offsets is None else offsets.to(device)
        if self._offsets[key] is None:
            return None
        mods = [(*s.scale1, *s.shift, *s.gate) for s in inputs]
        kps, vps, biases = ([getattr(s, f) for s in inputs] for f in ("kp", "vp", "bias"))
        return layer_tables.layer_table(self._offsets[key], mods, kps, vps, biases)

    def timed_out(self) -> int:
        """Kept workspaces whose persistent launches had a wait run past its bound
        (kernels/work_queue.py: their results are wrong). Reads the device: benches, tests
        and the frame loop (every WAIT_CHECK_CYCLES, after the chunk's copy has synced),
        never inside the action's path."""
        flags = [w[3][-1] for w in self._attention.values()]
        flags += [s.phases[-1] for s in self._steps.values()]
        return sum(int(f.item()) for f in flags)

    def attention(self, q: torch.Tensor, kp: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The expert attention's workspace for q [H, Hq, D] over prefix keys kp [P, Hkv, D]
        on CUDA; None elsewhere (the reference path, or the interpreter's own per call)."""
        if not q.is_cuda:
            return None
        (h_len, hq, d), (n_p, hkv) = q.shape, kp.shape[:2]
        key = (h_len, hq, hkv, d, n_p, q.dtype, q.device)
        if key not in self._attention:
            self._attention[key] = expert_workspace(h_len, hq, hkv, d, n_p, q.dtype, q.device)
        return self._attention[key]

    def get(self, h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (n, width), k = h.shape, w.shape[1]
        key = (n, width, k, h.dtype, h.device)
        if key not in self._work:
            cfg = gemm_residual.gemm_config(n, width, k, h.dtype)
            self._work[key] = gemm_residual.workspace(n, width, cfg, h.device)
        return self._work[key]
