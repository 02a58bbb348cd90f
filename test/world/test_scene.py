"""The scene's physics: deterministic, grasp only low and close, release into containers."""

import numpy as np
import pytest

from embodied_kv.world.scene import CONTAINER_RADIUS, STATE_DIM, Arm, Scene, Thing, make_scene


def make_two() -> Scene:
    return Scene([Thing("red", "bowl", 0.5, 0.5), Thing("blue", "block", -0.5, -0.5)],
                 Arm(x=-0.5, y=-0.5, z=1.0))  # fmt: skip


def act(x, y, z, g):
    return np.array([x, y, z, g, 0, 0, 0, 0], dtype=float)


def test_make_scene_is_seeded_and_unambiguous():
    a, b = make_scene(np.random.default_rng(7)), make_scene(np.random.default_rng(7))
    assert a == b
    assert a != make_scene(np.random.default_rng(8))
    for seed in range(200):
        s = make_scene(np.random.default_rng(seed))
        names = [t.name for t in s.things]
        assert len(set(names)) == len(names)
        held = [m.inside for m in s.movables if m.inside]
        assert len(set(held)) == len(held)  # at most one movable per container at start


def test_grasp_needs_low_gripper_then_carries_and_releases_into_container():
    s = make_two()
    s.step(act(-0.5, -0.5, 1.0, 1.0))  # closing high grasps nothing
    assert s.arm.holding is None and s.arm.closed
    s.step(act(-0.5, -0.5, 1.0, -1.0))
    for _ in range(4):
        s.step(act(-0.5, -0.5, -1.0, -1.0))
    s.step(act(-0.5, -0.5, -1.0, 1.0))
    assert s.arm.holding == "blue block"
    assert s.state().shape == (STATE_DIM,) and s.state()[4] == 1.0
    for _ in range(10):
        s.step(act(0.5, 0.5, 1.0, 1.0))
    block = s.get("blue block")
    assert (block.x, block.y) == (s.arm.x, s.arm.y) == pytest.approx((0.5, 0.5))
    s.step(act(0.5, 0.5, 1.0, -1.0))
    assert s.arm.holding is None and block.inside == "red bowl"


def test_release_outside_a_container_leaves_it_on_the_table():
    s = make_two()
    for _ in range(4):
        s.step(act(-0.5, -0.5, -1.0, -1.0))
    s.step(act(-0.5, -0.5, -1.0, 1.0))
    s.step(act(0.5 - 2 * CONTAINER_RADIUS, 0.5, -1.0, 1.0))
    s.step(act(0.0, 0.0, -1.0, -1.0))
    assert s.get("blue block").inside is None


def test_speed_limit_and_bad_action():
    s = make_two()
    s.step(act(1.0, 1.0, 1.0, -1.0))
    assert np.hypot(s.arm.x + 0.5, s.arm.y + 0.5) == pytest.approx(0.25)
    before = s.copy()
    with pytest.raises(ValueError, match="finite"):
        s.step(np.array([np.nan, 0, 0, 0]))
    with pytest.raises(ValueError, match="4 finite"):
        s.step(np.zeros(3))
    assert s == before
    with pytest.raises(ValueError, match="no 'green ball'"):
        s.get("green ball")
