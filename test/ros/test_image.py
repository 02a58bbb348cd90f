"""Camera messages -> model input: encodings, the references' resize, CompressedImage,
size limits before decoding, rejections and the converter thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

from embodied_kv.ros.image import (  # noqa: E402
    ImageLimits,
    check_header,
    compressed_to_rgb,
    image_to_rgb,
    message_to_input,
    rgb_to_input,
)
from embodied_kv.ros.image_worker import ImageConverter  # noqa: E402

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


# -- resizing exactly as the references ------------------------------------------------------


def reference_resize_with_pad_torch(images, height, width, mode="bilinear", pad=0.0, lo=0.0):
    """LeRobot `resize_with_pad_torch` (policies/common/vla_utils.py), an exact copy of openpi's
    `image_tools.resize_with_pad_torch`, channels-first float32 branch; LeRobot clamps to
    [0, 1] and pads 0, openpi's torch path clamps to [-1, 1] and pads -1 (pad, lo)."""
    batch_size, channels, cur_height, cur_width = images.shape
    ratio = max(cur_width / width, cur_height / height)
    resized_height = int(cur_height / ratio)
    resized_width = int(cur_width / ratio)
    resized_images = F.interpolate(
        images, size=(resized_height, resized_width), mode=mode, align_corners=False
    )
    resized_images = resized_images.clamp(lo, 1.0)
    pad_h0, remainder_h = divmod(height - resized_height, 2)
    pad_h1 = pad_h0 + remainder_h
    pad_w0, remainder_w = divmod(width - resized_width, 2)
    pad_w1 = pad_w0 + remainder_w
    return F.pad(resized_images, (pad_w0, pad_w1, pad_h0, pad_h1), mode="constant", value=pad)


def lerobot_image(rgb: np.ndarray, size: int) -> torch.Tensor:
    """LeRobot pi05 `_preprocess_images`: [0, 1] float, resize_with_pad_torch, * 2 - 1."""
    img = torch.from_numpy(rgb).permute(2, 0, 1)[None].to(torch.float32) / 255.0
    return (reference_resize_with_pad_torch(img, size, size) * 2.0 - 1.0)[0]


def openpi_image(rgb: np.ndarray, size: int) -> torch.Tensor:
    """openpi torch path: uint8 -> [-1, 1] (Observation.from_dict), then resize_with_pad_torch."""
    img = torch.from_numpy(rgb).permute(2, 0, 1)[None].to(torch.float32) / 255.0 * 2.0 - 1.0
    return reference_resize_with_pad_torch(img, size, size, pad=-1.0, lo=-1.0)[0]


@pytest.mark.parametrize(
    "h,w,resized", [(480, 640, (168, 224)), (480, 854, (125, 224)), (101, 150, (150, 224))]
)
def test_resize_with_pad_is_the_references(h, w, resized):
    rgb = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = rgb_to_input(rgb, 224)
    assert ours.shape == (3, 224, 224) and ours.dtype == torch.float32
    assert torch.equal(ours, lerobot_image(rgb, 224))  # bytes
    assert torch.allclose(ours, openpi_image(rgb, 224), atol=2e-6)  # same maths, other order
    rh, rw = resized  # int(h / ratio): 480x854 -> 125 rows (round() would give 126)
    top, left = (224 - rh) // 2, (224 - rw) // 2
    content = torch.zeros(224, 224, dtype=torch.bool)
    content[top : top + rh, left : left + rw] = True
    assert bool((ours[:, ~content] == -1.0).all())  # the padding
    assert bool((ours[:, content] > -1.0).any(dim=0).reshape(rh, rw).any(dim=1).all())  # rows


# -- CompressedImage -----------------------------------------------------------------------


def compressed(data: bytes, fmt: str = "jpeg") -> CompressedImage:
    return CompressedImage(format=fmt, data=data)


def test_png_round_trip_is_exact_and_jpeg_decodes_as_pillow_does(image_files):
    encode, _ = image_files
    rgb = np.random.default_rng(1).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    assert np.array_equal(compressed_to_rgb(compressed(encode(rgb, "PNG"), "png")), rgb)
    assert np.array_equal(compressed_to_rgb(compressed(encode(rgb, "PNG"), "bgr8; png")), rgb)
    smooth = np.broadcast_to(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], (48, 64, 3))
    data = encode(np.ascontiguousarray(smooth), "JPEG", quality=95)
    decoded = compressed_to_rgb(compressed(data))
    assert decoded.shape == (48, 64, 3)
    assert np.abs(decoded.astype(int) - smooth).mean() < 2.0  # lossy, but the same picture
    grey = rgb[:, :, 0]
    mono = compressed_to_rgb(compressed(encode(grey, "PNG"), "mono8; png"))
    assert all(np.array_equal(mono[:, :, c], grey) for c in range(3))
    x = message_to_input(compressed(encode(rgb, "PNG"), "png"), size=32)
    assert torch.equal(x, rgb_to_input(rgb, 32))
    deep = np.full((4, 4), 40000, np.uint16)  # a 16-bit png (depth camera) is not 8-bit colour
    with pytest.raises(ValueError, match="PNG of mode I;16.* is not supported"):
        compressed_to_rgb(compressed(encode(deep, "PNG"), "png"))


def test_oversized_frames_are_refused_from_the_header_before_any_decode(image_files):
    _, png_header_only = image_files
    limits = ImageLimits()
    huge = compressed(png_header_only(8000, 8000), "png")
    with pytest.raises(ValueError, match=r"8000x8000 image exceeds the limits.*not decoded"):
        compressed_to_rgb(huge, limits)
    wide = compressed(png_header_only(8000, 4), "png")
    with pytest.raises(ValueError, match=r"8000x4 image exceeds the limits.*not decoded"):
        compressed_to_rgb(wide, limits)
    # the same file under limits that admit it is decoded, and only then found cut short
    with pytest.raises(ValueError, match=r"corrupt png \(8000x4\): image file is truncated"):
        compressed_to_rgb(wide, ImageLimits(max_width=8000))
    raw = Image(height=8000, width=8000, encoding="rgb8", step=24000, data=b"")  # header only
    with pytest.raises(ValueError, match="8000x8000 image exceeds the limits"):
        check_header(raw, limits)
    with pytest.raises(ValueError, match="8000x8000 image exceeds"):
        message_to_input(raw, 32, limits)
    small = ImageLimits(max_bytes=1000)
    with pytest.raises(ValueError, match="2000 bytes of image data > max_bytes 1000"):
        compressed_to_rgb(compressed(bytes(2000)), small)
    with pytest.raises(ValueError, match="10x6 image exceeds the limits .*max_pixels 50"):
        check_header(message(RGB, "rgb8"), ImageLimits(max_pixels=50))


@pytest.mark.parametrize(
    "data,fmt,complaint",
    [
        (None, "jpeg", "corrupt jpeg"),  # a real jpeg cut in half
        (b"\xff\xd8\xff" + bytes(200), "jpeg", "not a readable jpeg or png"),
        (b"GIF89a" + bytes(40), "gif", "not a readable jpeg or png"),
        (b"", "jpeg", "zero-size compressed image"),
        (b"\x89PNG", "16UC1; compressedDepth png", "depth is not a camera image"),
    ],
)
def test_bad_compressed_images_are_value_errors_with_the_reason(data, fmt, complaint, image_files):
    encode, _ = image_files
    if data is None:
        rgb = np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        full = encode(rgb, "JPEG", quality=90)
        data = full[: len(full) // 2]
    with pytest.raises(ValueError, match=complaint):
        message_to_input(compressed(data, fmt), size=32)


# -- the converter thread -------------------------------------------------------------------


def test_converter_keeps_only_the_latest_frame_per_camera_and_reports_bad_ones():
    delivered, rejected, done = [], [], threading.Event()

    def deliver(index, image):
        delivered.append((index, image))
        done.set()

    frames = [np.full((4, 6, 3), v, np.uint8) for v in (10, 20, 30)]
    converter = ImageConverter(
        lambda msg: message_to_input(msg, 8), deliver, lambda kind, why: rejected.append(why)
    )
    for f in frames:  # the thread is not running yet: they queue up
        converter.submit(0, "front", message(f, "rgb8"))
    assert converter.pending() == 1 and converter.replaced == 2
    converter.start()
    try:
        assert done.wait(5.0)
        assert len(delivered) == 1 and delivered[0][0] == 0
        assert torch.equal(delivered[0][1], rgb_to_input(frames[-1], 8))  # the newest
        converter.submit(1, "wrist", compressed(b"\xff\xd8\xff" + bytes(10)))
        deadline = time.monotonic() + 5.0
        while not rejected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rejected and rejected[0].startswith("camera wrist: CompressedImage")
        assert "frame skipped" in rejected[0]
    finally:
        converter.stop()
    assert not converter.running
