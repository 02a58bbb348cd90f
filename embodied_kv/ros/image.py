"""sensor_msgs/Image -> the model's camera input: [3, S, S] float32 in [-1, 1].

cv_bridge is used when it imports and converts a ROS 2 Image correctly (a probe at
first use); PyPI's `cv-bridge` is a ROS 1 copy that fails on ROS 2 messages
(shared/ROS2_PIP.md), so normally the converter here does the work for rgb8, bgr8,
rgba8, bgra8 and mono8. Any other encoding, a zero-size image or data whose size
does not match height x step is a ValueError with the reason: the frame is skipped.

Resizing keeps the aspect ratio and pads with black (-1) to S x S, as pi0.5's
`resize_with_pad` does (openpi / LeRobot preprocessing).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

# encoding -> (channels, source channel of R, G, B)
ENCODINGS: dict[str, tuple[int, tuple[int, int, int]]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, (0, 0, 0)),
}


def image_to_rgb(msg) -> np.ndarray:
    """[H, W, 3] uint8 RGB of a sensor_msgs/Image; ValueError naming what is wrong."""
    if msg.encoding not in ENCODINGS:
        raise ValueError(
            f"encoding {msg.encoding!r} is not supported (use one of {', '.join(ENCODINGS)})"
        )
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    if h == 0 or w == 0 or len(msg.data) == 0:
        raise ValueError(f"zero-size image ({w}x{h}, {len(msg.data)} bytes)")
    channels, order = ENCODINGS[msg.encoding]
    if step < w * channels:
        raise ValueError(f"step {step} < width {w} x {channels} bytes per pixel")
    if len(msg.data) != h * step:
        raise ValueError(
            f"{msg.encoding} {w}x{h} with step {step} needs {h * step} bytes, got {len(msg.data)}"
        )
    bridge = _working_cv_bridge()
    if bridge is not None:
        return np.asarray(bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8"))
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(h, step)
    pixels = rows[:, : w * channels].reshape(h, w, channels)
    return pixels[:, :, list(order)]


def rgb_to_input(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] float32 in [-1, 1], resized with padding."""
    h, w, _ = rgb.shape
    x = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).float()  # [3, H, W]
    x = x / 127.5 - 1.0
    scale = size / max(h, w)
    rh, rw = max(1, round(h * scale)), max(1, round(w * scale))
    if (rh, rw) != (h, w):
        x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", antialias=True)[0]
    out = torch.full((3, size, size), -1.0)
    top, left = (size - rh) // 2, (size - rw) // 2
    out[:, top : top + rh, left : left + rw] = x.clamp_(-1.0, 1.0)
    return out


def image_to_input(msg, size: int) -> torch.Tensor:
    return rgb_to_input(image_to_rgb(msg), size)


@functools.cache
def _working_cv_bridge():
    """A CvBridge if one imports and round-trips a ROS 2 rgb8 Image exactly, else None."""
    try:
        from cv_bridge import CvBridge
        from sensor_msgs.msg import Image

        probe = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
        msg = Image(height=2, width=3, encoding="rgb8", step=9, data=probe.tobytes())
        out = np.asarray(CvBridge().imgmsg_to_cv2(msg, desired_encoding="rgb8"))
        return CvBridge() if out.shape == probe.shape and (out == probe).all() else None
    except Exception:  # absent, or the ROS 1 copy from PyPI: the converter above
        return None
