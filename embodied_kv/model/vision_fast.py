"""SigLIP's encoder layers as few kernels, over the HF module's own parameters (issue 33).

    HF eager (reference)                          fast (default)
    LayerNorm                                     (the previous layer's last kernel)
    q, k, v GEMMs (3), view + transpose each      one q/k/v GEMM, bias in the GEMM (QkvFusion)
    q k^T, scale, fp32 softmax, cast, p v,        scaled_dot_product_attention (one kernel;
    transpose + contiguous copy                   its output rows are already [tokens, W])
    out_proj GEMM, residual add, LayerNorm        out_proj GEMM (bias in it), add_layer_norm
    fc1 GEMM, GELU-tanh                           fc1 GEMM (bias in it), GELU-tanh
    fc2 GEMM, residual add                        fc2 GEMM (bias in it), add_layer_norm with
    (next layer's LayerNorm / post_layernorm)     the next layer's layer_norm1 / post_layernorm

On CUDA `add_layer_norm` is one Triton kernel (kernels/add_layer_norm.py): 8 kernels per
layer against the eager path's 18 (21 for several cameras: its attention copies rows),
counted at the dispatcher by test/model/test_vision_fast.py; pi05's 27-layer tower, 3
cameras: 222 kernels, eager 573. Elsewhere it is its reference, add then LayerNorm. The
sums run in the reference's order (GEMM + bias, then + the residual), so fp32 differs from
HF's eager forward only by the attention's reduction order (and HF's fp32 softmax).

The HF `SiglipVisionModel` stays the owner of the weights: checkpoint keys, loaders and
optimizers see its q/k/v Parameters, which `QkvFusion` makes views of one [3W, W] weight
and one [3W] bias (the same Parameter objects, their `.data` re-pointed; nothing stored
twice). An in-place load or optimizer step writes into the fused storage, so the fused
GEMM (and a CUDA graph captured over it) reads the new weights. Every call checks on the
host that the parameters still view that storage; after `.to(...)`, a replaced Parameter
or `load_state_dict(assign=True)` it fuses again from the current values. With autograd
on for the weights the GEMM reads `torch.cat` of the Parameters (differentiable; training
pays two small copies per layer), never the fused tensor, which no gradient would reach.

Supported: SigLIP without attention mask or attention dropout (pi0.5's tower: 27 layers,
width 1152, 16 heads of 72), any float dtype, any device SDPA runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embodied_kv.kernels import add_layer_norm as residual_norm


class QkvFusion:
    """q/k/v weights and biases of one SigLIP attention as views of one storage each."""

    def __init__(self, attn: nn.Module):
        self.linears = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.weight: torch.Tensor | None = None  # [3W, W]; held, so its address stays ours
        self.bias: torch.Tensor | None = None  # [3W]
        self._ptrs: tuple[int, ...] = ()

    def _params(self) -> list[torch.Tensor]:
        return [lin.weight for lin in self.linears] + [lin.bias for lin in self.linears]

    def current(self) -> bool:
        """The parameters still view this fusion's storage (host check, no device sync)."""
        return self._ptrs == tuple(p.data_ptr() for p in self._params())

    @torch.no_grad()
    def fuse(self) -> None:
        """Concatenate the current values and re-point each Parameter's data at its rows."""
        self.weight = torch.cat([lin.weight for lin in self.linears])
        self.bias = torch.cat([lin.bias for lin in self.linears])
        row = 0
        for lin in self.linears:
            n = lin.weight.shape[0]
            lin.weight.data = self.weight[row : row + n]
            lin.bias.data = self.bias[row : row + n]
            row += n
        self._ptrs = tuple(p.data_ptr() for p in self._params())

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weight [3W, W], bias [3W]) for this call: the fused storage, or under
        autograd (or a compiler trace, which has no data_ptr) the differentiable concat."""
        params = self._params()
        if torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and any(p.requires_grad for p in params)
        ):
            return torch.cat(params[:3]), torch.cat(params[3:])
        if not self.current():
            self.fuse()
        return self.weight, self.bias


def encoder_layer(
    layer: nn.Module, fusion: QkvFusion, x: torch.Tensor, xn: torch.Tensor, cams: int,
    next_norm: nn.LayerNorm,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One SiglipEncoderLayer over the stream x [C*P, W] and its layer_norm1 xn -> (the
    stream after the layer, `next_norm` of it: the next layer's layer_norm1 or the tower's
    post_layernorm)."""
    attn, mlp, width = layer.self_attn, layer.mlp, x.shape[-1]
    heads, d = attn.num_heads, attn.head_dim
    w_qkv, b_qkv = fusion.weights()
    qkv = torch.addmm(b_qkv, xn, w_qkv.t())  # [C*P, 3W]
    q, k, v = qkv.view(cams, -1, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)  # [C, H, P, D]
    o = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)  # [C, H, P, D]
    o = o.transpose(1, 2).reshape(-1, width)  # a view where SDPA wrote [C, P, H, D]
    y = torch.addmm(attn.out_proj.bias, o, attn.out_proj.weight.t())
    n2 = layer.layer_norm2
    x, xn = residual_norm.add_layer_norm(x, y, n2.weight, n2.bias, n2.eps)
    a = F.gelu(torch.addmm(mlp.fc1.bias, xn, mlp.fc1.weight.t()), approximate="tanh")
    y = torch.addmm(mlp.fc2.bias, a, mlp.fc2.weight.t())
    return residual_norm.add_layer_norm(x, y, next_norm.weight, next_norm.bias, next_norm.eps)


def check_supported(encoder: nn.Module) -> None:
    """ValueError where the HF config asks for what `encoder_layer` does not compute."""
    cfg = encoder.config
    if cfg.attention_dropout:
        raise ValueError(f"attention_dropout={cfg.attention_dropout}: the fast path has none")
    if cfg.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: the fast path runs GELU-tanh")


class FastEncoder:
    """The HF SiglipEncoder's layers and the tower's post_layernorm run by `encoder_layer`,
    one QkvFusion per layer."""

    def __init__(self, encoder: nn.Module, post_layernorm: nn.LayerNorm):
        check_supported(encoder)
        self.layers = list(encoder.layers)
        self.post_layernorm = post_layernorm
        self.fusions = [QkvFusion(layer.self_attn) for layer in self.layers]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """inputs_embeds [C, P, W] -> post_layernorm(last hidden state) [C, P, W]."""
        cams, _, width = h.shape
        x = h.reshape(-1, width)
        n1 = self.layers[0].layer_norm1
        xn = F.layer_norm(x, (width,), n1.weight, n1.bias, n1.eps)
        norms = [layer.layer_norm1 for layer in self.layers[1:]] + [self.post_layernorm]
        for layer, fusion, norm in zip(self.layers, self.fusions, norms, strict=True):
            x, xn = encoder_layer(layer, fusion, x, xn, cams, norm)
        return xn.view(h.shape)
