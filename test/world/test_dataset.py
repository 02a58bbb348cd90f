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
