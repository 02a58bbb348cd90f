"""Where the things the text names are, regressed from the name's own row (issue 34).

Two skills need a text row that knows where a named object is: "is the red ball left of
the blue box ?" (0.74-0.83 teacher-forced on the shipped weights, on training and held-out
scenes alike: underfit, not overfit) and the `ar` mode's first action id, predicted at
the prompt's last row (step 0's x and y off by ~0.5 in action units, teacher-forced).

The grounding head's object outputs (train/grounding.py) already read, from each image
row after `ground_layer` layers, the table (x, y) of the thing that patch shows. Here the
same two outputs read the row of the last token of each name ("key" of "the red key"): the
instruction's movable and container in the prompt, and each thing a scene question names
(world/questions.py `QA.named`; rows from train/batch.py `name_ends`), and regress that
thing's (x, y). The name's row has to fetch its object's position from the image rows it
attends to; what reads it later (the answer's row, the first action id's row, the expert
through the prefix K/V) finds it in the same code as the image rows. Training only: the
head is not in weights.safetensors, and inference runs the same model."""

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
