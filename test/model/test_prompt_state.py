"""The state in the pi0.5 prompt: only the robot's dims, binned as the references bin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodied_kv.model.prompt import discretize_state, format_prompt, tokenize_prompt
from embodied_kv.model.vla import Observation


def reference_prompt(task: str, state: np.ndarray) -> str:
    """LeRobot `Pi05PrepareStateTokenizerProcessorStep.__call__` (= openpi
    `PaligemmaTokenizer.tokenize` with a state): digitize minus 1, no clip, no padding."""
    cleaned_text = task.strip().replace("_", " ").replace("\n", " ")
    discretized = np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    state_str = " ".join(map(str, discretized))
    return f"Task: {cleaned_text}, State: {state_str};\nAction: "


def test_prompt_holds_only_the_robots_dims_and_matches_the_reference():
    state = np.array([-0.5, 0.0, 0.731], dtype=np.float32)  # a 3-dim robot
    task = " pick_up the\ncube "
    assert format_prompt(task, state) == reference_prompt(task, state)
    assert format_prompt(task, state) == "Task: pick up the cube, State: 64 128 221;\nAction: "


def test_states_below_minus_one_are_bin_minus_one_not_clipped():
    state = np.array([-1.5, -1.0, -0.9999, 0.999, 1.0, 7.0])
    expected = np.digitize(state, bins=np.linspace(-1, 1, 257)[:-1]) - 1
    assert discretize_state(state).tolist() == expected.tolist() == [-1, 0, 0, 255, 255, 255]
    assert "State: -1 0 0 255 255 255;" in format_prompt("t", state)


def test_prefix_embeds_the_unpadded_prompt(tiny_model):
    """An 8-dim-capable model given a 3-dim state embeds exactly the reference prompt's
    ids (no 128s for absent dims)."""
    cfg = tiny_model.cfg
    s = cfg.vision.image_size
    state = np.array([0.1, -0.2, 0.3])
    obs = Observation(torch.zeros(cfg.num_cameras, 3, s, s), state, "stack")
    prefix = tiny_model.embed_prefix(obs)
    ids = tiny_model.tokenizer.encode(reference_prompt("stack", state), bos=True)
    text = prefix.embeds[cfg.num_cameras * cfg.vision.tokens :]
    expected = tiny_model.backbone.embed(torch.tensor(ids))
    assert torch.equal(text, expected)
    assert tokenize_prompt(tiny_model.tokenizer, "stack", state, cfg.max_text_tokens).ids == ids


def test_a_state_longer_than_the_model_takes_is_refused(tiny_model):
    cfg = tiny_model.cfg
    s = cfg.vision.image_size
    obs = Observation(torch.zeros(cfg.num_cameras, 3, s, s), np.zeros(cfg.state_dim + 1), "x")
    with pytest.raises(ValueError, match=f"state of {cfg.state_dim + 1} dims > the model's"):
        tiny_model.embed_prefix(obs)
