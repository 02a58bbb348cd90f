"""Training chunks for training-time real-time chunking (world/executed_prefix.py): the
first d actions executed (the expert's plan, or a detour from it), the rest the expert's
continuation from the state they reach."""

import numpy as np
import pytest

from embodied_kv.world.dataset import DataConfig, make_sample, rollout_state
from embodied_kv.world.executed_prefix import executed_chunk
from embodied_kv.world.expert import expert_chunk
from embodied_kv.world.scene import MAX_XY_STEP, MAX_Z_STEP

H = 30
DATA = DataConfig(horizon=H, labels="waypoints", rollout="task", first_share=0.3,
                  arm_start_share=0.5)  # fmt: skip


def state(seed):
    return rollout_state(DATA, np.random.default_rng(seed))


def test_without_a_detour_it_is_the_expert_s_chunk():
    for seed in range(6):
        scene, task = state(seed)
        plan = expert_chunk(scene, task, H, "waypoints")
        for held, detour in ((0, True), (4, False), (8, False)):
            got = executed_chunk(scene, task, H, "waypoints", held, detour,
                                 np.random.default_rng(1))  # fmt: skip
            assert np.array_equal(got, plan)


def test_a_detour_is_executed_and_the_rest_continues_from_where_it_leaves_the_arm():
    departed = 0
    for seed in range(40):
        scene, task = state(seed)
        before = scene.state().copy()
        held = 1 + seed % 8
        got = executed_chunk(scene, task, H, "waypoints", held, True,
                             np.random.default_rng(seed))  # fmt: skip
        assert np.array_equal(scene.state(), before)  # the scene is not changed
        plan = expert_chunk(scene, task, H, "waypoints")
        departed += not np.array_equal(got[:held], plan[:held])
        sim = scene.copy()
        for row in got[:held]:
            sim.step(row)
        arm = np.array([sim.arm.x, sim.arm.y, sim.arm.z])
        assert np.array_equal(got[held:], expert_chunk(sim, task, H - held, "waypoints"))
        # the first free action is one step of the arm from where the executed ones left it
        step = got[held, :3] - arm
        assert np.hypot(*step[:2]) <= MAX_XY_STEP + 1e-9 and abs(step[2]) <= MAX_Z_STEP + 1e-9
    assert departed >= 30  # a detour departs from the plan (a shift can hit a still plan)


def test_held_beyond_the_chunk_is_refused():
    scene, task = state(0)
    with pytest.raises(ValueError, match="held 31"):
        executed_chunk(scene, task, H, "waypoints", 31, True, np.random.default_rng(0))


def test_samples_carry_held_only_when_the_run_trains_it():
    on = DataConfig(**{**vars(DATA), "prefix_max": 8, "prefix_detour": 0.5})
    helds = []
    for seed in range(30):
        off, s = make_sample(DATA, seed), make_sample(on, seed)
        assert off.held is None and 0 <= s.held <= 8
        helds.append(s.held)
        # the same observation and text: only the chunk's rows can differ
        assert np.array_equal(off.images, s.images) and off.turns == s.turns
        if s.held == 0:
            assert np.array_equal(off.actions, s.actions)
    assert len(set(helds)) >= 5
    free = DataConfig(**{**vars(on), "prefix_free": 0.5})
    zeros = sum(make_sample(free, seed).held == 0 for seed in range(60))
    assert 25 <= zeros <= 50  # half of them, then 1 in 9 of the rest
    for bad in ({"prefix_detour": 0.5}, {"prefix_free": 0.5}):
        with pytest.raises(ValueError, match="need prefix_max"):
            DataConfig(**bad)
    with pytest.raises(ValueError, match="prefix_max -1"):
        DataConfig(prefix_max=-1)
