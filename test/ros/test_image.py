"""sensor_msgs/Image -> model input: every supported encoding, padding, rejections."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from sensor_msgs.msg import Image  # noqa: E402

from embodied_kv.ros.image import image_to_rgb, message_to_input  # noqa: E402

RGB = np.random.default_rng(0).integers(0, 256, (6, 10, 3), dtype=np.uint8)


def message(pixels: np.ndarray, encoding: str, pad: int = 0) -> Image:
    h, w = pixels.shape[:2]
    rows = pixels.reshape(h, -1)
    rows = np.concatenate([rows, np.zeros((h, pad), np.uint8)], axis=1)  # row padding
    return Image(height=h, width=w, encoding=encoding, step=rows.shape[1], data=rows.tobytes())


@pytest.mark.parametrize(
    "encoding,pixels",
    [
        ("rgb8", RGB),
        ("bgr8", RGB[:, :, ::-1]),
        ("rgba8", np.concatenate([RGB, np.full((6, 10, 1), 7, np.uint8)], axis=2)),
        ("bgra8", np.concatenate([RGB[:, :, ::-1], np.full((6, 10, 1), 7, np.uint8)], axis=2)),
    ],
)
def test_color_encodings_give_the_same_rgb(encoding, pixels):
    assert np.array_equal(image_to_rgb(message(pixels, encoding)), RGB)
    assert np.array_equal(image_to_rgb(message(pixels, encoding, pad=5)), RGB)


def test_mono8_is_grey_in_every_channel():
    grey = RGB[:, :, 0]
    rgb = image_to_rgb(message(grey[:, :, None], "mono8"))
    assert all(np.array_equal(rgb[:, :, c], grey) for c in range(3))


def test_input_keeps_aspect_and_pads_with_black():
    x = message_to_input(message(np.full((16, 32, 3), 255, np.uint8), "rgb8"), size=32)
    assert x.shape == (3, 32, 32) and x.dtype.is_floating_point
    assert float(x[:, 8:24].min()) == 1.0  # the image, white, scaled to 16 x 32
    assert float(x[:, :8].max()) == -1.0 and float(x[:, 24:].max()) == -1.0  # padding


@pytest.mark.parametrize(
    "msg,complaint",
    [
        (Image(height=2, width=2, encoding="yuv422", step=4, data=bytes(8)), "not supported"),
        (Image(height=2, width=2, encoding="16UC1", step=4, data=bytes(8)), "not supported"),
        (Image(height=0, width=4, encoding="rgb8", step=12, data=b""), "zero-size"),
        (Image(height=2, width=2, encoding="rgb8", step=6, data=b""), "zero-size"),
        (Image(height=2, width=2, encoding="rgb8", step=6, data=bytes(11)), "needs 12 bytes"),
        (Image(height=2, width=4, encoding="rgb8", step=6, data=bytes(12)), "step 6 < width 4"),
    ],
)
def test_bad_images_are_value_errors_with_the_reason(msg, complaint):
    with pytest.raises(ValueError, match=complaint):
        message_to_input(msg, size=32)
