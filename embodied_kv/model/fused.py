"""Fused projections: q/k/v as one GEMM and gate/up as one GEMM per layer, over one weight
storage that the checkpoint's parameters are views of.

A pi05 action runs 10 Euler steps x 18 expert layers of 50-row GEMMs: at that size each
GEMM is a launch of a few microseconds, so five of them where two would do is ~540 kernels
per action. `fuse_projections` concatenates each layer's q, k, v rows (and gate, up rows)
into one tensor and makes every nn.Linear weight a Parameter viewing its rows: the
parameter names, shapes and dtypes stay the checkpoint's, loaders keep copying into them
in place (so the fused tensor sees every load), and nothing is stored twice.

Every call checks (on the host, no device sync) that autograd is off and that the weights
still view the fused storage; in training, after `model.to(...)` or a replaced Parameter the
layer runs separate GEMMs, never stale or gradient-less weights. `build_model` fuses on
CUDA only: on the CPU the separate GEMMs are the reference whose bytes the exactness tests
pin. The LeRobot-style baseline (model/hf_interop.py) always runs separate GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn


class RowFusion:
    """One [sum of out features, in] storage for several nn.Linear weights."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.weight = torch.cat([lin.weight.detach() for lin in linears])
        self.sizes = [lin.weight.shape[0] for lin in linears]
        row = 0
        for lin, n in zip(linears, self.sizes, strict=True):
            grad = lin.weight.requires_grad
            lin.weight = nn.Parameter(self.weight[row : row + n], requires_grad=grad)
            row += n
        self._ptrs = self._current()

    def _current(self) -> tuple[int, ...]:
        return tuple(lin.weight.data_ptr() for lin in self.linears)

    def usable(self) -> bool:
        """Inference (the fused tensor is no Parameter: autograd would not reach the
        checkpoint's weights through it) and the parameters still view this storage (not
        replaced or moved)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # no data_ptr in a trace
            return False
        return self._current() == self._ptrs

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One GEMM, then a view per linear: x [N, in] -> [N, out_i] each (row strides of
        the fused output; every kernel downstream takes a contiguous last dim)."""
        return torch.nn.functional.linear(x, self.weight).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up of every transformer layer of `model` -> layers fused."""
    from embodied_kv.model.layers import GemmaLayer

    layers = [m for m in model.modules() if isinstance(m, GemmaLayer)]
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        a.fusion = RowFusion([a.q_proj, a.k_proj, a.v_proj])
        mlp.fusion = RowFusion([mlp.gate_proj, mlp.up_proj])
    return len(layers)
