"""The position probe: held-out R² of a linear fit, and the probe over a real model."""

import numpy as np

from embodied_kv.eval.position_probe import held_out_r2, probe
from embodied_kv.eval.world import random_model
from embodied_kv.model.trained import world_config


def test_r2_is_one_for_a_linear_code_and_about_zero_for_noise():
    rng = np.random.default_rng(0)
    y = rng.uniform(-1, 1, size=(400, 2))
    mix = rng.normal(size=(2, 6))
    linear = y @ mix + 0.01 * rng.normal(size=(400, 6))
    assert held_out_r2(linear, y).min() > 0.99
    assert held_out_r2(rng.normal(size=(400, 6)), y).max() < 0.1


def test_the_probe_reads_every_layer_of_a_world_model():
    model = random_model(world_config())
    out = probe(model, samples=4)
    layers = model.cfg.backbone.layers
    assert set(out) == {f"{kind} {i}" for kind in ("values", "keys") for i in range(layers)} | {
        "image tokens"}
    assert all(len(v) == 4 and np.isfinite(v).all() for v in out.values())
