"""A camera image in pixels -> the model's camera input: [3, S, S] float32 in [-1, 1].

One function for every way in (ROS camera messages, ros/image.py; openpi frames,
serve/layouts.py), so a frame gives the model the same bytes whichever way it came.

Resizing is LeRobot's `resize_with_pad_torch` (policies/common/vla_utils.py, "exact
copy" of openpi's torch path): pixels / 255 in [0, 1], bilinear without antialiasing to
int(h / ratio) x int(w / ratio) with ratio = max(w / S, h / S), clamp to [0, 1], padded
centred with 0, then * 2 - 1 (pi05 `_preprocess_images`), so the padding is -1.
`rgb_to_input_ref` is that chain written plainly; `rgb_to_input` gives the same bytes
with less work (test/model/test_image_input.py).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F


def rgb_to_input(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] float32 in [-1, 1]: rgb_to_input_ref's bytes."""
    return rgbs_to_input([rgb], size)[0]


def rgbs_to_input(rgbs: list[np.ndarray], size: int) -> torch.Tensor:
    """N images [H, W, 3] uint8 -> [N, 3, size, size] float32 in [-1, 1], contiguous:
    each image rgb_to_input_ref's bytes.

    Faster, the same values. Few calls: images of one geometry go through each op
    together (one bilinear, one add, one clamp for a camera's frames), because on a
    CPU whose caches the model has just flushed every call costs tens of microseconds
    whatever its size. Per image, uint8 / 255 straight into the thread's float buffer
    (no float copy first; division is correctly rounded in torch and numpy alike), and
    when resizing only over the source rows the bilinear kernel reads (`_rows_read`).
    Torch's bilinear kernel as F.interpolate calls it, without its Python checks,
    writing into the output (padding around it); clamp, * 2 and - 1 as one add and one
    clamp in place."""
    if not rgbs:
        raise ValueError("no image to convert")
    if any(rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 for rgb in rgbs):
        raise ValueError(f"images must be [H, W, 3] uint8, got "
                         f"{[(r.shape, str(r.dtype)) for r in rgbs]}")  # fmt: skip
    shapes = {rgb.shape[:2] for rgb in rgbs}
    if len(shapes) > 1:  # cameras of different sizes: one group each
        return torch.cat([rgbs_to_input([rgb], size) for rgb in rgbs])
    (h, w), n = shapes.pop(), len(rgbs)
    buf, chw = _buffer(n, h, w)  # [n, h, w, 3] float32 and its [n, 3, h, w] view
    out = torch.empty(n, 3, size, size)
    if (h, w) == (size, size):  # pi05 `_preprocess_images` resizes only another size
        for k, rgb in enumerate(rgbs):
            np.divide(rgb, _255, out=buf[k])
        torch.mul(chw, 2.0, out=out)
        return out.sub_(1.0)
    rh, rw = resized(h, w, size)
    rows = _rows_read(h, w, rh, rw)
    for k, rgb in enumerate(rgbs):
        if rows is None:
            np.divide(rgb, _255, out=buf[k])
        else:  # rows outside `rows` are never read
            buf[k, rows] = np.divide(rgb[rows], _255, dtype=np.float32)
    top, left = (size - rh) // 2, (size - rw) // 2
    inner = out
    if (rh, rw) != (size, size):
        out.fill_(-1.0)  # the padding: 0 in [0, 1]
        inner = out[:, :, top : top + rh, left : left + rw]
    # [n, 3, H, W] strided as the reference's (the same kernel); F.interpolate's own call
    _bilinear(chw, (rh, rw), False, None, None, out=inner)
    # clamp(x, 0, 1) * 2 - 1 == clamp(2x - 1, -1, 1) in float32: 2x is exact
    torch.add(_MINUS_ONE, inner, alpha=2.0, out=inner).clamp_(-1.0, 1.0)
    return out  # [n, 3, size, size]


_bilinear = torch._C._nn.upsample_bilinear2d  # what F.interpolate(mode="bilinear") calls
_MINUS_ONE = torch.tensor(-1.0)
_255 = np.float32(255.0)
MAX_BUFFER = 8 << 20  # bytes: a thread keeps float images this large for the next
_buffers = threading.local()


def _buffer(n: int, h: int, w: int) -> tuple[np.ndarray, torch.Tensor]:
    """[n, h, w, 3] float32 of this thread and its [n, 3, h, w] torch view, kept for its
    next images of that size (warm pages, no allocation); read only where just written
    (the bilinear's and the add's results are new tensors)."""
    kept = getattr(_buffers, "x", None)
    if kept is not None and kept[0].shape == (n, h, w, 3):
        return kept
    buf = np.empty((n, h, w, 3), np.float32)
    kept = buf, torch.from_numpy(buf).permute(0, 3, 1, 2)
    if buf.nbytes <= MAX_BUFFER:
        _buffers.x = kept
    return kept


@functools.lru_cache(maxsize=64)
def _rows_read(h: int, w: int, rh: int, rw: int) -> np.ndarray | None:
    """The source rows torch's bilinear (align_corners=False) reads to make rh rows of
    h: y0 = int(max(0, h / rh * (i + 0.5) - 0.5)) and min(y0 + 1, h - 1), float32 as its
    CPU kernel. Checked once per geometry: an image that is NaN outside these rows must
    resize to no NaN (0 * NaN is NaN), else None (convert every row). None too when
    they are over 3/4 of the rows."""
    if min(rh, rw) < 1:  # interpolate refuses it, as it refuses the reference
        return None
    scale = np.float32(h) / np.float32(rh)
    src = scale * (np.arange(rh, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    y0 = np.maximum(src, 0).astype(np.int64)
    rows = np.unique(np.concatenate([y0, np.minimum(y0 + 1, h - 1)]))
    if 4 * len(rows) > 3 * h:
        return None
    probe = torch.full((h, w, 3), float("nan"))
    probe[torch.from_numpy(rows)] = 0.5
    out = F.interpolate(probe.permute(2, 0, 1)[None], size=(rh, rw), mode="bilinear",
                        align_corners=False)  # fmt: skip
    return None if bool(out.isnan().any()) else rows


def resized(h: int, w: int, size: int) -> tuple[int, int]:
    """The image's size inside the padded size x size square (resize_with_pad_torch)."""
    ratio = max(w / size, h / size)
    return int(h / ratio), int(w / ratio)


def rgb_to_input_ref(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] float32 in [-1, 1] (LeRobot resize_with_pad_torch)."""
    rgb = np.require(rgb, np.uint8, ["C", "W"])  # torch wants writable memory; copies if not
    x = torch.from_numpy(rgb).permute(2, 0, 1).to(torch.float32) / 255.0
    return resize_with_pad(x[None], size)[0]


def resize_with_pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """[n, 3, H, W] float in [0, 1] on any device -> [n, 3, size, size] in [-1, 1]: the
    reference's chain (bilinear without antialiasing, clamp, padding 0, * 2 - 1)."""
    h, w = x.shape[-2:]
    if (h, w) != (size, size):  # pi05 `_preprocess_images` resizes only another size
        rh, rw = resized(h, w, size)
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False)
        x = x.clamp(0.0, 1.0)
        top, left = (size - rh) // 2, (size - rw) // 2
        x = F.pad(x, (left, size - rw - left, top, size - rh - top), value=0.0)
    return x * 2.0 - 1.0  # [n, 3, size, size]
