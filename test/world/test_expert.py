"""The scripted expert solves the tasks; its chunks are its own future commands."""

import numpy as np
import pytest

from embodied_kv.world.expert import expert_action, expert_chunk, labels_of
from embodied_kv.world.scene import MAX_XY_STEP, MAX_Z_STEP, make_scene
from embodied_kv.world.tasks import sample_task


def test_expert_solves_every_seeded_task_within_25_steps():
    for seed in range(300):
        rng = np.random.default_rng(seed)
        scene = make_scene(rng)
        task = sample_task(scene, rng)
        assert not task.success(scene)
        for _ in range(25):
            scene.step(expert_action(scene, task)[0])
            if task.success(scene):
                break
        assert task.success(scene), (seed, task)


def test_chunk_is_the_expert_run_forward_and_leaves_the_scene_alone():
    rng = np.random.default_rng(3)
    scene = make_scene(rng)
    task = sample_task(scene, rng)
    before = scene.copy()
    chunk = expert_chunk(scene, task, 10)
    assert scene == before and chunk.shape == (10, 8)
    for a in chunk:
        assert np.array_equal(a, expert_action(scene, task)[0])
        scene.step(a)
    with pytest.raises(ValueError, match="horizon"):
        expert_chunk(scene, task, 0)


def test_waypoints_move_the_arm_as_the_targets_do_one_step_at_a_time():
    """The waypoint labels (world_smooth) are the arm's own path: commanding them moves
    the arm exactly as the far targets do, and each is within one step's reach of the
    last, so consecutive actions differ by the arm's motion alone."""
    target_jumps = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        scene = make_scene(rng)
        task = sample_task(scene, rng)
        for _ in range(int(rng.integers(0, 8))):  # somewhere along the task
            scene.step(expert_action(scene, task)[0])
        targets = expert_chunk(scene, task, 30)
        waypoints = expert_chunk(scene, task, 30, "waypoints")
        assert np.array_equal(targets[:, 3:], waypoints[:, 3:])  # gripper and padding
        a, b = scene.copy(), scene.copy()
        for k in range(30):
            a.step(targets[k])
            b.step(waypoints[k])
            assert np.allclose((a.arm.x, a.arm.y, a.arm.z), (b.arm.x, b.arm.y, b.arm.z),
                               atol=1e-12, rtol=0)  # fmt: skip
            assert np.allclose(waypoints[k, :3], (b.arm.x, b.arm.y, b.arm.z), atol=1e-12)
            assert a.arm.holding == b.arm.holding and task.success(a) == task.success(b)
        path = np.vstack([scene.state()[:3], waypoints[:, :3]])
        steps = np.diff(path, axis=0)
        assert np.hypot(steps[:, 0], steps[:, 1]).max() <= MAX_XY_STEP + 1e-9
        assert np.abs(steps[:, 2]).max() <= MAX_Z_STEP + 1e-9
        target_jumps.append(np.linalg.norm(np.diff(targets[:, :3], axis=0), axis=1).max())
    assert max(target_jumps) >= 1.5  # the far targets flip (z +1 <-> -1) where waypoints step
    with pytest.raises(ValueError, match="labels"):
        expert_chunk(scene, task, 3, "deltas")
    assert labels_of("world_smooth") == "waypoints" and labels_of("world") == "targets"
