"""Which parameters keep fp32 when the model runs in bf16, as the references do.

    fp32   SigLIP patch + position        openpi gemma_pytorch.to_bfloat16_for_selected_params
           embeddings
           every RMSNorm weight and      openpi and LeRobot: "input_layernorm",
           adaptive-norm dense layer     "post_attention_layernorm", "model.norm" (the adaRMS
                                         dense layers sit inside them)
           action in/out projections,    openpi pi0_pytorch / LeRobot PI05Pytorch: they live
           time MLP                      outside paligemma_with_expert, the part that is cast
    bf16   token embedding (= LM head), backbone and expert projections, the SigLIP
           encoder and the projector

LeRobot's newest PaliGemmaWithExpertModel keeps the whole vision tower and projector
fp32 (to keep the optimizer's dtypes fixed in training). Here openpi's inference choice
is followed: an fp32 SigLIP is 0.6 TFLOP per 3-camera frame at fp32 GEMM rates, 9 ms on
an H100 without TF32, more than the whole bf16 budget (the limit, bench/limit.py: 6.6 ms).

The Euler state of the flow is fp32 too (model/expert.py). Dtypes are set on the meta
device, before any byte is allocated (`build_model`): no fp32 copy of the bf16
parameters ever exists.
"""

from __future__ import annotations

import torch
from torch import nn

from embodied_kv.model.layers import AdaRMSNorm, RMSNorm


def fp32_modules(model: nn.Module) -> list[nn.Module]:
    """The VLA's submodules whose parameters stay fp32 under a low-precision dtype."""
    e = model.expert
    keep = [model.vision.tower.embeddings, e.action_in_proj, e.action_out_proj]
    keep += [e.time_mlp_in, e.time_mlp_out]
    keep += [m for m in model.modules() if isinstance(m, RMSNorm | AdaRMSNorm)]
    return keep


def apply_precision(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter its dtype under `dtype` (in place; free on the meta device).

    Buffers keep theirs (RoPE tables are fp32, position ids int64)."""
    if not dtype.is_floating_point:
        raise ValueError(f"model dtype must be a floating point type, got {dtype}")
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if dtype != torch.float32:
        for m in fp32_modules(model):
            for p in m.parameters():
                p.data = p.data.float()


def param_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}
