"""Samples are a pure function of (config, seed) and carry all three targets."""

import numpy as np
import pytest

from embodied_kv.world.dataset import TEXT_KINDS, DataConfig, make_sample
from embodied_kv.world.questions import WHERE_WORDS
from embodied_kv.world.render import label_of


def test_samples_are_reproducible_and_mixed():
    cfg = DataConfig()
    a, b = make_sample(cfg, 11), make_sample(cfg, 11)
    for f in ("images", "state", "actions"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert (a.instruction, a.suffix, a.target) == (b.instruction, b.suffix, b.target)
    kinds = [make_sample(cfg, s).kind for s in range(60)]
    assert set(kinds) == set(TEXT_KINDS)
    s = make_sample(cfg, 5)
    assert s.images.shape == (2, 3, 64, 64) and s.actions.shape == (10, 8)


def test_bad_data_config():
    with pytest.raises(ValueError, match="text_mix"):
        DataConfig(text_mix=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="shares"):
        DataConfig(two_hop_share=1.5)
    with pytest.raises(ValueError, match="two_hop_answer"):
        DataConfig(two_hop_answer="route")


def test_path_answers_train_two_hop_plans_container_first():
    """`two_hop_answer="path"`: the same samples, the two-hop targets written as the way to
    the place; one-hop targets and every other sample unchanged."""
    place, path = DataConfig(text_mix=(0, 1, 0, 0), two_hop_share=0.5), DataConfig(
        text_mix=(0, 1, 0, 0), two_hop_share=0.5, two_hop_answer="path")
    longer = 0
    for seed in range(6):
        a, b = make_sample(place, seed), make_sample(path, seed)
        assert [t[0] for t in a.turns] == [t[0] for t in b.turns]  # the same prompts
        for (_, x), (_, y) in zip(a.turns, b.turns, strict=True):
            assert y == x or (y.startswith("in the ") and y.endswith(f" on the {x}"))
            longer += y != x
    assert longer > 3


# the world_ramp run's data flags (its flags file is under
# bench/results/2026-11-26-cpu-intel-xeon-2core/): its samples before issue 34
RAMP = DataConfig(text_mix=(.2, .6, .05, .15), turns=8, memory_objects=8, memory_updates=24,
                  memory_hard=0.5, two_hop_answer="path")  # fmt: skip


def test_the_new_options_at_their_defaults_leave_old_runs_samples_as_they_were():
    """Samples 3 and 2**33 + 7 as the code before issue 34 drew them (state, chunk sum,
    first turn): a run saved then resumes on the same data."""
    s = make_sample(RAMP, 3)
    assert s.instruction == "put the blue ball in the red bowl" and s.kind == "plan"
    assert np.allclose(s.state[:3], (0.4519, 0.1232, 1.0), atol=1e-4)
    assert round(float(s.actions.sum()), 6) == 5.751548 and s.target == "shelf"
    s = make_sample(RAMP, 2**33 + 7)
    assert np.allclose(s.state[:3], (0.4177, -0.6851, 0.0), atol=1e-4)
    assert s.turns[0] == ("\nQuestion: is the green bowl left of the red bowl ?\nAnswer: ", "no")


def test_task_rollout_samples_states_before_the_success_and_the_first_state():
    fixed = [make_sample(DataConfig(), seed) for seed in range(120)]
    assert sum(s.phase == "done" for s in fixed) > 20  # the old states: a third after success
    task = DataConfig(rollout="task", first_share=0.3, arm_start_share=0.5)
    samples = [make_sample(task, seed) for seed in range(120)]
    assert not any(s.phase == "done" for s in samples)
    first = [s for s in samples if np.allclose(s.state[:5], (0.0, -0.9, 1.0, -1.0, 0.0))]
    assert 0.2 < len(first) / len(samples) < 0.45  # 30 % drawn there, a few more by chance
    moved = DataConfig(rollout="task", arm_start_share=1.0, perturb=0.0)
    starts = [make_sample(moved, seed).state for seed in range(40)]
    assert np.std([s[0] for s in starts]) > 0.3  # random arm poses, not the start pose
    only_first = DataConfig(rollout="task", first_share=1.0)
    assert all(np.allclose(make_sample(only_first, seed).state[:3], (0.0, -0.9, 1.0))
               for seed in range(10))  # fmt: skip
    with pytest.raises(ValueError, match="rollout"):
        DataConfig(rollout="all")
    with pytest.raises(ValueError, match="shares"):
        DataConfig(first_share=1.5)


def test_ground_labels_mark_the_instruction_s_movable_and_container():
    seen = {1: 0, 2: 0}
    for seed in range(30):
        s = make_sample(DataConfig(rollout="task"), seed)
        movable, container = s.instruction[len("put the "):].split(" in the ")
        want_m = label_of(*movable.split(" "))
        want_c = label_of(*container.split(" "))
        assert np.array_equal(s.ground == 1, s.patches == want_m)
        assert np.array_equal(s.ground == 2, s.patches == want_c)
        seen[1] += int((s.ground == 1).any())
        seen[2] += int((s.ground == 2).any())
    assert seen[1] > 20 and seen[2] > 20  # visible in most frames (a movable may be held)


def test_where_questions_are_asked_at_their_share_only():
    cfg = DataConfig(text_mix=(1, 0, 0, 0), where_share=0.5)
    turns = [t for seed in range(20) for t in make_sample(cfg, seed).turns]
    where = [t for t in turns if t[0].startswith("\nQuestion: where is")]
    assert 0.3 < len(where) / len(turns) < 0.7 and {a for _, a in where} == set(WHERE_WORDS)
    plain = [t for seed in range(20) for t in make_sample(DataConfig(text_mix=(1, 0, 0, 0)),
                                                          seed).turns]  # fmt: skip
    assert not any("where is" in q for q, _ in plain)
