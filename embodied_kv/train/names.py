"""Where the things a question names are, regressed from the name's own row (issue 34:
"is the red ball left of the blue box ?" stayed at 0.75-0.78, teacher-forced on training
and held-out scenes alike: underfit, not overfit).

The grounding head's object outputs (train/grounding.py) already read, from each image
row after `ground_layer` layers, the table (x, y) of the thing that patch shows. Here the
same two outputs read the row of the last token of each name in a question ("ball" of
"the red ball"; the words come from world/questions.py `QA.named`, the rows from
train/batch.py `name_ends`) and regress that thing's (x, y): the name's row has to fetch
its object's position from the image rows it attends to, the comparison the answer needs
then reads two rows that hold positions in the same code as the image rows. Training
only: the head is not in weights.safetensors, and inference runs the same model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.world.dataset import GROUND


def name_loss(head, text_rows: torch.Tensor, at: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
    """MSE of the head's object outputs on text_rows [B, T, W] at `at` [M, 2] (sample,
    text index) against `xy` [M, 2]; 0 (with a graph) when the batch names nothing."""
    if not head.centres:
        raise ValueError("the name regression reads the grounding head's object outputs: "
                         "give object_weight > 0")  # fmt: skip
    if at.numel() == 0:
        return text_rows.sum() * 0.0
    rows = text_rows[at[:, 0], at[:, 1]]  # [M, W]
    pred = head(rows[None])[0, :, len(GROUND) :]
    return F.mse_loss(pred, xy.to(pred.device))
