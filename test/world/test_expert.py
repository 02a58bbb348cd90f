"""The scripted expert solves the tasks; its chunks are its own future commands."""

import numpy as np
import pytest

from embodied_kv.world.expert import expert_action, expert_chunk
from embodied_kv.world.scene import make_scene
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
