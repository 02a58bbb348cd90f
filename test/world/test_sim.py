"""world/sim.py, the demo's simulated world: actions through Scene.step, an episode ends
on success or at the step limit, and the next seeded episode begins."""

from __future__ import annotations

import numpy as np
import pytest

from embodied_kv.world.expert import expert_action
from embodied_kv.world.render import CAMERAS, render
from embodied_kv.world.sim import WorldSim, camera_of


def test_expert_actions_finish_episodes_back_to_back():
    sim = WorldSim(seed=123)
    first = sim.instruction
    ended = 0
    for _ in range(400):
        action, _ = expert_action(sim.scene, sim.task)
        ended += sim.apply(action)
        if ended == 3:
            break
    assert [r.index for r in sim.results] == [0, 1, 2] and sim.successes() == 3
    assert all(r.steps < 60 for r in sim.results) and sim.results[0].instruction == first
    assert sim.index == 3 and sim.steps == 0  # the fourth episode begins, fresh
    again = WorldSim(seed=123)  # seeded: the same episodes
    assert again.instruction == first
    assert np.array_equal(again.image("top", 64), WorldSim(seed=123).image("top", 64))


def test_step_limit_fails_an_episode_and_bad_actions_change_nothing():
    sim = WorldSim(seed=5, max_steps=3)
    hold = np.zeros(8)
    before = sim.state().copy()
    with pytest.raises(ValueError, match="4 finite leading values"):
        sim.apply([np.nan, 0, 0, 0])
    assert np.array_equal(sim.state(), before) and sim.steps == 0
    assert [sim.apply(hold) for _ in range(3)] == [False, False, True]
    assert sim.results[0].success is False and sim.results[0].steps == 3
    assert np.array_equal(sim.image("front", 32), render(sim.scene, "front", 32))
    with pytest.raises(ValueError, match="max_steps=0"):
        WorldSim(seed=0, max_steps=0)


def test_configured_cameras_map_to_world_cameras():
    assert [camera_of(n, i) for i, n in enumerate(["top", "front"])] == list(CAMERAS)
    assert [camera_of(n, i) for i, n in enumerate(["front", "wrist"])] == ["front", "front"]
    assert camera_of("wrist", 0) == "top"
    with pytest.raises(ValueError, match="renders only"):
        camera_of("left", 2)


def test_an_episode_records_the_stage_it_ended_at():
    """Holding still from the start: stuck at the approach; the expert: done."""
    sim = WorldSim(seed=7, max_steps=4)
    for _ in range(4):
        sim.apply(np.zeros(8) + [0.0, -0.9, 1.0, -1.0, 0, 0, 0, 0])
    assert sim.results[0].success is False and sim.results[0].stage == "approach"
    sim = WorldSim(seed=7, max_steps=8)  # the expert until it holds the movable, then waits
    while sim.scene.arm.holding is None:
        sim.apply(expert_action(sim.scene, sim.task)[0])
    a = sim.scene.arm
    while sim.steps:
        sim.apply([a.x, a.y, a.z, 1.0])
    assert sim.results[0].stage == "carry"
    sim = WorldSim(seed=7)
    while not sim.apply(expert_action(sim.scene, sim.task)[0]):
        pass
    assert sim.results[0].success and sim.results[0].stage == "done"
