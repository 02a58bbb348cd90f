"""The training-only grounding head (issue 34): from the image rows of the backbone's
residual stream after `layer` layers, each patch's class among dataset.GROUND (the
instruction's named movable, its named container, anything else).

The image rows attend to the prompt (the prefix is bidirectional), so by layer 2-3 they
can know which object the instruction names; the head makes them say so, and the action
expert reads those rows' keys and values. The head lives in the training state only:
weights.safetensors (what the engine loads) never holds it.

Class weights 1 / 10 / 4 (other / movable / container) as in the issue's control
experiment: the named movable covers ~1.7 % of the patches, its container ~8 %.

With `centres` the head has two more outputs: the table (x, y) of the thing each patch
shows (train/losses.py object_loss), so the rows the expert's deeper layers read say where
the named object is, not only which patches it covers (position_probe: without it the
object's x fell from R² 0.72 in the image tokens to 0.17-0.36 in layers 2-3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.world.dataset import GROUND

CLASS_WEIGHTS = (1.0, 10.0, 4.0)  # other, named movable, named container


class GroundHead(torch.nn.Module):
    def __init__(self, width: int, layer: int, class_weights=CLASS_WEIGHTS,
                 centres: bool = False):  # fmt: skip
        super().__init__()
        if layer < 1 or len(class_weights) != len(GROUND) or min(class_weights) <= 0:
            raise ValueError(f"ground head: layer {layer} >= 1 and {len(GROUND)} class "
                             f"weights > 0 ({class_weights})")  # fmt: skip
        self.layer = layer
        self.class_weights = tuple(float(w) for w in class_weights)
        self.centres = centres
        self.proj = torch.nn.Linear(width, len(GROUND) + (2 if centres else 0))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, I, W] residual rows -> [B, I, len(GROUND)] logits (scale-free input), then
        [B, I, 2] object centres with `centres`."""
        return self.proj(F.layer_norm(rows.float(), rows.shape[-1:]))

    def loss(self, rows: torch.Tensor, labels: torch.Tensor, centres=None):
        """-> (weighted cross-entropy, recall of the named movable's patches, the object
        regression's MSE against `centres` [B, I, 2] (0 without the outputs))."""
        out = self(rows)
        logits = out[..., : len(GROUND)]
        obj = object_loss(out[..., len(GROUND) :], centres) if self.centres else out.sum() * 0
        w = torch.tensor(self.class_weights, device=logits.device)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=w)
        movable = labels == 1
        hit = (logits.argmax(-1) == 1) & movable
        recall = float(hit.sum()) / max(1, int(movable.sum()))
        return loss, recall, obj


def object_loss(pred: torch.Tensor, centres: torch.Tensor | None) -> torch.Tensor:
    """MSE of [B, I, 2] predictions against each patch's object centre (world/dataset.py
    object_centres) over the patches that show a thing (the rest are NaN)."""
    if centres is None:
        raise ValueError("the object regression needs the batch's centres (train/batch.py)")
    centres = centres.to(pred.device)
    shown = torch.isfinite(centres[..., 0])
    if not bool(shown.any()):
        return pred.sum() * 0.0
    return F.mse_loss(pred[shown], centres[shown])
