"""Synthetic observations for the demo, benchmarks and tests (seeded, no files)."""

from __future__ import annotations

import numpy as np
import torch

from embodied_kv.model.config import ModelConfig
from embodied_kv.model.vla import Observation


def synthetic_observation(
    cfg: ModelConfig,
    seed: int,
    instruction: str = "pick up the red block",
    camera_mask: tuple[bool, ...] | None = None,
) -> Observation:
    """Random images in [-1, 1] and a random state in [-1, 1], both from `seed`."""
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    state = np.random.default_rng(seed).uniform(-1, 1, cfg.state_dim)
    return Observation(images, state, instruction, camera_mask)
