"""Camera messages -> the model's camera input: [3, S, S] float32 in [-1, 1].

sensor_msgs/Image: rgb8, bgr8, rgba8, bgra8 and mono8, converted here (cv_bridge only
where one imports and converts a ROS 2 probe image correctly: PyPI's `cv-bridge` is a
ROS 1 copy that fails on ROS 2 messages). sensor_msgs/CompressedImage:
jpeg or png, decoded with Pillow (only those two decoders are tried).

Size limits (ImageLimits) are checked before any pixel is touched: for a raw Image on
its header fields; for a CompressedImage on the byte length, then on the dimensions
Pillow reads from the file header (`Image.open` is lazy), before the full decode. An
8000 x 8000 frame is refused at the cost of reading its header. Any other problem
(unsupported encoding, zero size, data that does not match the header, a corrupt
file) is a ValueError with the reason: the frame is skipped.

Resizing: model/image_input.py (rgb_to_input), shared with `embodied-kv serve`.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass

import numpy as np
import torch

from embodied_kv.model.image_input import rgb_to_input

# encoding -> (channels, source channel of R, G, B)
ENCODINGS: dict[str, tuple[int, tuple[int, int, int]]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, (0, 0, 0)),
}
COMPRESSED_FORMATS = ("JPEG", "PNG")  # Pillow format names tried on CompressedImage data
PILLOW_MODES = ("RGB", "RGBA", "L", "LA", "P")  # 8-bit modes that convert to RGB unchanged


@dataclass(frozen=True)
class ImageLimits:
    """Largest camera frame accepted (YAML prefill `image.*`)."""

    max_width: int = 4096  # pixels
    max_height: int = 4096  # pixels
    max_pixels: int = 4096 * 4096  # width x height
    max_bytes: int = 64 << 20  # message data (raw or compressed), bytes

    def __post_init__(self):
        if min(self.max_width, self.max_height, self.max_pixels, self.max_bytes) < 1:
            raise ValueError(f"image limits must be >= 1: {self}")

    def check_size(self, w: int, h: int) -> None:
        if w > self.max_width or h > self.max_height or w * h > self.max_pixels:
            raise ValueError(
                f"{w}x{h} image exceeds the limits (max_width {self.max_width}, max_height "
                f"{self.max_height}, max_pixels {self.max_pixels}); not decoded"
            )

    def check_bytes(self, n: int) -> None:
        if n > self.max_bytes:
            raise ValueError(f"{n} bytes of image data > max_bytes {self.max_bytes}; not decoded")


DEFAULT_LIMITS = ImageLimits()


def check_header(msg, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """Everything about a message that is known without touching its pixels."""
    if hasattr(msg, "encoding"):
        _check_raw(msg, limits)
    else:
        limits.check_bytes(len(msg.data))
        if "compresseddepth" in msg.format.lower().replace(" ", ""):
            raise ValueError(f"CompressedImage format {msg.format!r}: depth is not a camera image")
        if len(msg.data) == 0:
            raise ValueError("zero-size compressed image (0 bytes)")


def _check_raw(msg, limits: ImageLimits) -> None:
    if msg.encoding not in ENCODINGS:
        raise ValueError(
            f"encoding {msg.encoding!r} is not supported (use one of {', '.join(ENCODINGS)})"
        )
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    limits.check_size(w, h)
    limits.check_bytes(len(msg.data))
    if h == 0 or w == 0 or len(msg.data) == 0:
        raise ValueError(f"zero-size image ({w}x{h}, {len(msg.data)} bytes)")
    channels, _ = ENCODINGS[msg.encoding]
    if step < w * channels:
        raise ValueError(f"step {step} < width {w} x {channels} bytes per pixel")
    if len(msg.data) != h * step:
        raise ValueError(
            f"{msg.encoding} {w}x{h} with step {step} needs {h * step} bytes, got {len(msg.data)}"
        )


def image_to_rgb(msg, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """[H, W, 3] uint8 RGB of a sensor_msgs/Image; ValueError naming what is wrong."""
    _check_raw(msg, limits)
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    channels, order = ENCODINGS[msg.encoding]
    bridge = _working_cv_bridge()
    if bridge is not None:
        return np.asarray(bridge.imgmsg_to_cv2(msg, desired_encoding="rgb8"))
    rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(h, step)
    pixels = rows[:, : w * channels].reshape(h, w, channels)
    return pixels[:, :, list(order)]


def compressed_to_rgb(msg, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """[H, W, 3] uint8 RGB of a sensor_msgs/CompressedImage (jpeg / png)."""
    from PIL import Image, UnidentifiedImageError

    check_header(msg, limits)
    data = bytes(msg.data)
    try:
        img = Image.open(io.BytesIO(data), formats=COMPRESSED_FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise ValueError(
            f"CompressedImage ({msg.format!r}, {len(data)} bytes) is not a readable jpeg or png"
        ) from None
    except Exception as e:  # e.g. Pillow's own DecompressionBombError on a huge header
        raise ValueError(f"CompressedImage header unreadable: {type(e).__name__}: {e}") from None
    with img:
        w, h = img.size
        limits.check_size(w, h)
        if img.mode not in PILLOW_MODES:
            raise ValueError(f"{img.format} of mode {img.mode} is not supported (8-bit only)")
        try:
            img.load()
        except Exception as e:  # truncated or corrupt data: OSError, SyntaxError, ...
            raise ValueError(f"corrupt {img.format.lower()} ({w}x{h}): {e}") from None
        return np.asarray(img.convert("RGB"))


def message_to_input(msg, size: int, limits: ImageLimits = DEFAULT_LIMITS) -> torch.Tensor:
    """An Image or a CompressedImage -> [3, size, size]; ValueError with the reason."""
    if hasattr(msg, "encoding"):
        return rgb_to_input(image_to_rgb(msg, limits), size)
    return rgb_to_input(compressed_to_rgb(msg, limits), size)


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
