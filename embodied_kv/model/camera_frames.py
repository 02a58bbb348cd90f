"""Camera frames as they arrive, converted by the model on its own device.

An Observation's images are either the model's input ([num_cameras, 3, S, S] float in
[-1, 1], converted by the caller: the ROS image callbacks, the world's renderer) or
`CameraFrames`: the cameras' uint8 [H, W, 3] pixels of any size, converted inside
`VLA.embed_prefix`, so inside the cycle's timed action latency (camera frames -> chunk,
as openpi's server times its input transforms inside `infer_ms`).

    CPU     image_input.rgbs_to_input: rgb_to_input_ref's bytes, as before
    CUDA    the uint8 pixels go up (a quarter of the float bytes) and the reference's
            chain runs there (`device_input`): /255, bilinear, clamp, pad, * 2 - 1

Everything that can be wrong with a frame is refused when it is built (ValueError), so
the conversion inside the cycle cannot fail on the caller's input. Absent cameras are
None: never converted, masked by the Observation's camera_mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from embodied_kv.model.image_input import resize_with_pad, resized, rgbs_to_input


class CameraFrames:
    """The cameras' frames in model order, each uint8 [H, W, 3] or None (absent)."""

    __slots__ = ("frames", "size", "_input")

    def __init__(self, frames: Sequence[np.ndarray | None], size: int):
        if size < 1:
            raise ValueError(f"image size {size} < 1")
        for i, rgb in enumerate(frames):
            if rgb is not None:
                _check(rgb, size, i)
        self.frames, self.size = tuple(frames), size
        self._input: tuple[tuple, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The model input's shape: [num_cameras, 3, S, S]."""
        return (len(self.frames), 3, self.size, self.size)

    def present(self) -> list[int]:
        return [i for i, rgb in enumerate(self.frames) if rgb is not None]

    def to_input(self, cameras: Sequence[int], device: torch.device | str) -> torch.Tensor:
        """[len(cameras), 3, S, S] float32 in [-1, 1] on `device`: the model's input of
        those (present) cameras. Kept for the next call with the same cameras and device
        (the prefill's, then a capsule's): read it, never write it."""
        cameras = tuple(cameras)
        key = (cameras, str(torch.device(device)))
        if self._input is not None and self._input[0] == key:
            return self._input[1]  # this observation's prefill and its capsule: once
        rgbs = [self.frames[i] for i in cameras]
        if any(rgb is None for rgb in rgbs):
            raise ValueError(f"cameras {list(cameras)}: some are absent")
        if key[1] == "cpu":
            out = rgbs_to_input(rgbs, self.size)
        else:
            out = device_input(rgbs, self.size, device)
        self._input = key, out
        return out

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[num_cameras, 3, S, S] converted on `device` (the bytes its prefill reads: the
        prefill's conversion when it is kept), returned on the CPU, zeros for absent
        cameras: a capsule's."""
        out = torch.zeros(self.shape)
        present = self.present()
        if present:
            out[present] = self.to_input(present, device).cpu()
        return out


def device_input(rgbs: list[np.ndarray], size: int, device: torch.device | str) -> torch.Tensor:
    """The reference's chain (image_input.resize_with_pad) over the uint8 pixels uploaded
    to `device`, cameras of one geometry in one call each. On the CPU the reference's
    bytes; on CUDA CUDA's kernels."""
    groups: dict[tuple[int, int], list[int]] = {}
    for k, rgb in enumerate(rgbs):
        groups.setdefault(rgb.shape[:2], []).append(k)
    out = torch.empty(len(rgbs), 3, size, size, device=device)
    for ks in groups.values():
        pixels = torch.from_numpy(np.stack([rgbs[k] for k in ks]))  # [n, h, w, 3] uint8
        x = pixels.to(device).permute(0, 3, 1, 2).to(torch.float32) / 255.0
        out[ks] = resize_with_pad(x, size)
    return out


def _check(rgb: np.ndarray, size: int, i: int) -> None:
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8:
        raise ValueError(f"camera {i}: expected a uint8 array, got "
                         f"{getattr(rgb, 'dtype', type(rgb).__name__)}")  # fmt: skip
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"camera {i}: shape {rgb.shape}, expected [H, W, 3]")
    h, w, _ = rgb.shape
    if min(h, w) < 1 or min(resized(h, w, size)) < 1:
        raise ValueError(f"camera {i}: {w}x{h} pixels resize to nothing at {size}x{size}")
