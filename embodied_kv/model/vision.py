"""Vision tower (SigLIP, no pooling head) and the linear projector to the backbone.

The HF `SiglipVisionModel` holds the weights (checkpoint keys, loaders); its encoder runs
as few kernels per layer by default (model/vision_fast.py: fused q/k/v, SDPA), HF's eager
forward with `reference=True`."""

from __future__ import annotations

import torch
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from embodied_kv.model.config import VisionConfig
from embodied_kv.model.vision_fast import FastEncoder


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, out_width: int):
        super().__init__()
        self.cfg = cfg
        hf = SiglipVisionConfig(
            hidden_size=cfg.width,
            intermediate_size=cfg.mlp,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            vision_use_head=False,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6,
        )
        hf._attn_implementation = "eager"
        # transformers < 5.6 wraps the layers in `.vision_model` (LeRobot 0.6.1 pins 5.4-5.5);
        # later ones hold them directly: the same module, so the same parameter names
        model = SiglipVisionModel(hf)
        self.tower = getattr(model, "vision_model", model)
        self.projector = nn.Linear(cfg.width, out_width)
        self.fast = FastEncoder(self.tower.encoder, self.tower.post_layernorm)  # no params

    def reset_buffers(self) -> None:
        """Non-parameter state lost when the module was built on the meta device."""
        emb = self.tower.embeddings
        n = emb.position_ids.shape[-1]
        emb.position_ids.copy_(torch.arange(n, device=emb.position_ids.device).expand(1, -1))

    def forward(self, images: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """images [C, 3, S, S] in [-1, 1] -> image tokens [C, P, W_backbone]; `reference`:
        the encoder as HF's eager forward (the fast path's tests compare against it)."""
        s = self.cfg.image_size
        if images.dim() != 4 or tuple(images.shape[1:]) != (3, s, s):
            raise ValueError(f"expected images [C, 3, {s}, {s}], got {tuple(images.shape)}")
        t = self.tower
        # openpi keeps the patch and position embeddings fp32 (model/precision.py); the
        # encoder and projector run in the model dtype. = SiglipVisionModel.forward.
        emb = t.embeddings(images.to(t.embeddings.patch_embedding.weight.dtype))
        dtype = self.projector.weight.dtype
        if reference:
            feats = t.post_layernorm(t.encoder(inputs_embeds=emb.to(dtype)).last_hidden_state)
        else:
            # [C, P, W] rows (the conv's layout is [C, W, P]): one cast-copy, not two
            feats = self.fast(emb.to(dtype, memory_format=torch.contiguous_format))
        return self.projector(feats)  # [C, P, W_backbone]
