"""Rendering: right shapes, colours where the objects are, depth order, model input range."""

import numpy as np
import pytest

from embodied_kv.world.render import (
    ARM_OPEN_RGB,
    CAMERAS,
    LABELS,
    RGB,
    label_map,
    label_of,
    observation_images,
    patch_labels,
    render,
)
from embodied_kv.world.scene import Arm, Scene, Thing, make_scene


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


def test_label_map_paints_what_render_paints():
    for seed in range(5):
        scene = make_scene(np.random.default_rng(seed))
        for cam in CAMERAS:
            img, lab = render(scene, cam, 64), label_map(scene, cam, 64)
            for t in scene.things:  # every pixel of a thing's class has the thing's colour
                mask = lab == label_of(t.colour, t.shape)
                assert (img[mask] == RGB[t.colour]).all()
            assert (lab > 0).sum() > 0 and (img[lab == 0] != ARM_OPEN_RGB).any(axis=-1).all()


def test_patch_labels_name_the_object_in_each_patch():
    scene = Scene([Thing("red", "block", -0.875 + 0.25 * 2, 0.875 - 0.25 * 5)])
    scene.arm.x, scene.arm.y = 0.6, 0.6
    labels = patch_labels(scene, 64, 8)  # 8 x 8 patches of 0.25 table units each
    assert labels.shape == (2, 64)
    top = labels[0].reshape(8, 8)
    assert top[5, 2] == label_of("red", "block")  # row from the far edge, column from the left
    assert set(np.unique(top)) == {0, label_of("red", "block"), LABELS.index("arm open")}
    with pytest.raises(ValueError, match="multiple of patch"):
        patch_labels(scene, 64, 7)
