"""A camera image in pixels -> the model's camera input: [3, S, S] float32 in [-1, 1].

One function for every way in (ROS camera messages, ros/image.py; openpi frames,
serve/layouts.py), so a frame gives the model the same bytes whichever way it came.

Resizing is LeRobot's `resize_with_pad_torch` (policies/common/vla_utils.py, "exact
copy" of openpi's torch path): pixels / 255 in [0, 1], bilinear without antialiasing to
int(h / ratio) x int(w / ratio) with ratio = max(w / S, h / S), clamp to [0, 1], padded
centred with 0, then * 2 - 1 (pi05 `_preprocess_images`), so the padding is -1.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def rgb_to_input(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] float32 in [-1, 1] (LeRobot resize_with_pad_torch)."""
    h, w, _ = rgb.shape
    rgb = np.require(rgb, np.uint8, ["C", "W"])  # torch wants writable memory; copies if not
    x = torch.from_numpy(rgb).permute(2, 0, 1).to(torch.float32) / 255.0
    if (h, w) != (size, size):  # pi05 `_preprocess_images` resizes only another size
        ratio = max(w / size, h / size)
        rh, rw = int(h / ratio), int(w / ratio)
        x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", align_corners=False)[0]
        x = x.clamp(0.0, 1.0)
        top, left = (size - rh) // 2, (size - rw) // 2
        x = F.pad(x, (left, size - rw - left, top, size - rh - top), value=0.0)
    return x * 2.0 - 1.0  # [3, size, size]
