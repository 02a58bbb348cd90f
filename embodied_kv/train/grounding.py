"""The training-only grounding head (issue 34): from the image rows of the backbone's
residual stream after `layer` layers, each patch's class among dataset.GROUND (the
instruction's named movable, its named container, anything else).

The image rows attend to the prompt (the prefix is bidirectional), so by layer 2-3 they
can know which object the instruction names; the head makes them say so, and the action
expert reads those rows' keys and values. The head lives in the training state only:
weights.safetensors (what the engine loads) never holds it.

Class weights 1 / 10 / 4 (other / movable / container) as in the issue's control
experiment: the named movable covers ~1.7 % of the patches, its container ~8 %."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.world.dataset import GROUND

CLASS_WEIGHTS = (1.0, 10.0, 4.0)  # other, named movable, named container


class GroundHead(torch.nn.Module):
    def __init__(self, width: int, layer: int, class_weights=CLASS_WEIGHTS):
        super().__init__()
        if layer < 1 or len(class_weights) != len(GROUND) or min(class_weights) <= 0:
            raise ValueError(f"ground head: layer {layer} >= 1 and {len(GROUND)} class "
                             f"weights > 0 ({class_weights})")  # fmt: skip
        self.layer = layer
        self.class_weights = tuple(float(w) for w in class_weights)
        self.proj = torch.nn.Linear(width, len(GROUND))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, I, W] residual rows -> [B, I, len(GROUND)] logits (scale-free input)."""
        return self.proj(F.layer_norm(rows.float(), rows.shape[-1:]))

    def loss(self, rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """-> (weighted cross-entropy, recall of the named movable's patches)."""
        logits = self(rows)
        w = torch.tensor(self.class_weights, device=logits.device)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=w)
        movable = labels == 1
        hit = (logits.argmax(-1) == 1) & movable
        recall = float(hit.sum()) / max(1, int(movable.sum()))
        return loss, recall
