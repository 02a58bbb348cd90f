"""Samples are a pure function of (config, seed) and carry all three targets."""

import numpy as np
import pytest

from embodied_kv.world.dataset import TEXT_KINDS, DataConfig, make_sample


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
