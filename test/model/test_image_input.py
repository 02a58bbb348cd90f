"""rgb_to_input (only the rows bilinear reads, uint8 / 255 in one op) gives
rgb_to_input_ref's bytes: every size, up and down, padded or not, any strides; and
rgbs_to_input (a camera's frames through each op together) each image's bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied_kv.model.image_input import (
    _rows_read,
    rgb_to_input,
    rgb_to_input_ref,
    rgbs_to_input,
)

SHAPES = [(224, 224), (480, 640), (480, 854), (101, 150), (31, 45), (640, 480), (224, 225),
          (1000, 700), (7, 3), (1, 1), (65, 64), (300, 200)]  # fmt: skip


def image(h: int, w: int, seed: int) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    rgb.flags.writeable = False  # as the wire's arrays: views of the frame's bytes
    return rgb


@pytest.mark.parametrize("size", [8, 32, 64, 224])
@pytest.mark.parametrize("h,w", SHAPES)
def test_the_references_bytes(h, w, size):
    rgb = image(h, w, h * w + size)
    want = rgb_to_input_ref(rgb, size)
    got = rgb_to_input(rgb, size)
    assert got.shape == want.shape == (3, size, size) and got.dtype == want.dtype
    assert torch.equal(got, want)
    chw_view = np.ascontiguousarray(rgb.transpose(2, 0, 1)).transpose(1, 2, 0)  # strided
    assert torch.equal(rgb_to_input(chw_view, size), want)


def test_every_value_and_the_unread_rows():
    rgb = np.arange(224 * 224 * 3, dtype=np.int64).reshape(224, 224, 3) % 256
    rgb = rgb.astype(np.uint8)
    assert torch.equal(rgb_to_input(rgb, 32), rgb_to_input_ref(rgb, 32))
    rows = _rows_read(224, 224, 32, 32)  # 224 -> 32: rows 7i + 3, 7i + 4
    want = sorted([7 * i + 3 for i in range(32)] + [7 * i + 4 for i in range(32)])
    assert rows is not None and rows.tolist() == want
    other = rgb.copy()
    unread = np.setdiff1d(np.arange(224), rows)
    other[unread] = 255 - other[unread]  # rows never read change nothing
    assert torch.equal(rgb_to_input(other, 32), rgb_to_input_ref(rgb, 32))
    assert _rows_read(224, 224, 224, 224) is None  # every row: the full conversion


def test_a_side_resized_to_nothing_is_refused_as_the_reference_refuses_it():
    rgb = image(1, 500, 0)
    with pytest.raises(RuntimeError):
        rgb_to_input_ref(rgb, 8)
    with pytest.raises(RuntimeError):
        rgb_to_input(rgb, 8)


@pytest.mark.parametrize("size", [8, 32, 224])
@pytest.mark.parametrize("h,w", [(224, 224), (480, 640), (31, 45), (65, 64)])
def test_frames_together_give_each_frames_bytes(h, w, size):
    rgbs = [image(h, w, seed) for seed in range(3)]
    want = torch.stack([rgb_to_input_ref(rgb, size) for rgb in rgbs])
    got = rgbs_to_input(rgbs, size)
    assert got.shape == (3, 3, size, size) and got.is_contiguous()  # as torch.stack gives
    assert torch.equal(got, want)
    again = rgbs_to_input(rgbs[:2], size)  # the thread's buffer resized, not stale
    assert torch.equal(again, want[:2]) and torch.equal(rgbs_to_input(rgbs, size), want)


def test_frames_of_different_sizes_and_none():
    rgbs = [image(100, 120, 0), image(224, 224, 1), image(100, 120, 2)]
    want = torch.stack([rgb_to_input_ref(rgb, 32) for rgb in rgbs])
    assert torch.equal(rgbs_to_input(rgbs, 32), want)
    with pytest.raises(ValueError, match="no image"):
        rgbs_to_input([], 32)
    with pytest.raises(ValueError, match="uint8"):
        rgbs_to_input([rgbs[0].astype(np.int64)], 32)
