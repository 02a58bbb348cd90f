"""Rendering: right shapes, colours where the objects are, depth order, model input range."""

import numpy as np
import pytest

from embodied_kv.world.render import RGB, observation_images, render
from embodied_kv.world.scene import Arm, Scene, Thing


def pixel(img, x, y):
    """Top camera pixel at table point (x, y)."""
    s = img.shape[0]
    return tuple(img[int((1 - y) / 2 * s), int((x + 1) / 2 * s)])


def test_top_view_draws_objects_in_their_colour():
    s = Scene([Thing("red", "block", -0.5, 0.5), Thing("blue", "ball", 0.5, -0.5)],
              Arm(x=0.9, y=0.9))  # fmt: skip
    img = render(s, "top", 64)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    assert pixel(img, -0.5, 0.5) == RGB["red"]
    assert pixel(img, 0.5, -0.5) == RGB["blue"]


def test_contents_drawn_over_their_container_and_gripper_state_visible():
    s = Scene([Thing("green", "box", 0.0, 0.0), Thing("yellow", "key", 0.0, 0.0, "green box")],
              Arm(x=-0.8, y=-0.8))  # fmt: skip
    img = render(s, "top", 64)
    assert pixel(img, 0.0, 0.0) == RGB["yellow"]
    closed = s.copy()
    closed.arm.closed = True
    for cam in ("top", "front"):
        assert not np.array_equal(render(s, cam, 32), render(closed, cam, 32))


def test_front_view_shows_height_and_observation_range():
    s = Scene([Thing("red", "ball", 0.0, 0.0)], Arm(x=0.5, z=1.0))
    low = s.copy()
    low.arm.z = -1.0
    assert not np.array_equal(render(s, "front", 32), render(low, "front", 32))
    obs = observation_images(s, 32)
    assert obs.shape == (2, 3, 32, 32) and obs.dtype == np.float32
    assert obs.min() >= -1.0 and obs.max() <= 1.0


def test_bad_camera_and_size():
    s = Scene([Thing("red", "ball", 0.0, 0.0)])
    with pytest.raises(ValueError, match="unknown camera"):
        render(s, "side", 32)
    with pytest.raises(ValueError, match="image size"):
        render(s, "top", 4)
