"""The engine's own chunk for an observation, computed in the test process with the
config the server reads, and the openpi observation dicts the tests send."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from embodied_kv.config_file import default_config_path, load_params
from embodied_kv.engine.engine import Engine
from embodied_kv.engine.startup import start_engine
from embodied_kv.model.image_input import rgb_to_input
from embodied_kv.model.vla import Observation
from embodied_kv.serve.config import serve_engine_config

PROMPT = "put the red block in the box"


def reference_engine(preset: str) -> Engine:
    params = load_params(default_config_path()).with_overrides(preset=preset)
    return start_engine(serve_engine_config(params), lambda line: None)


def chunks(engine: Engine, obs: Observation, n: int) -> list[np.ndarray]:
    """The chunks of frames 0..n-1 of a new episode, all of the same observation."""
    engine.begin_episode()
    out = []
    for frame in range(n):
        engine.observe(obs)
        out.append(engine.cycle(frame).chunk)
    return out


def pixels(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def state(engine: Engine, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, engine.robot.state_dim)


def request(layout: str, engine: Engine) -> tuple[dict, Observation]:
    """An openpi observation dict of `layout` and the Observation the engine should see
    (built here from the same pixels, independently of serve/layouts.py)."""
    s = engine.model.cfg.vision.image_size
    x = state(engine)
    a, b, c = pixels(1, 224, 224), pixels(2, 480, 640), pixels(3, 224, 224)
    if layout == "libero":
        msg = {"observation/image": a, "observation/wrist_image": b,
               "observation/state": x, "prompt": PROMPT}  # fmt: skip
        cams = [a, b]
    elif layout == "droid":
        msg = {"observation/exterior_image_1_left": a, "observation/wrist_image_left": b,
               "observation/joint_position": x[:-1], "observation/gripper_position": x[-1:],
               "prompt": PROMPT}  # fmt: skip
        cams = [a, b]
    else:  # aloha sends CHW, as openpi's ALOHA examples do
        hwc = {"cam_high": a, "cam_low": c, "cam_left_wrist": b, "cam_right_wrist": c}
        chw = {k: np.ascontiguousarray(v.transpose(2, 0, 1)) for k, v in hwc.items()}
        msg = {"images": chw, "state": x, "prompt": PROMPT}
        cams = [a, b, c]
    n = engine.model.cfg.num_cameras
    images = torch.stack([rgb_to_input(img, s) for img in cams[:n]])
    return msg, Observation(images, x, PROMPT)


@pytest.fixture(scope="session")
def serve_helpers():
    """The helpers above (test modules cannot import conftest under importlib mode)."""
    return types.SimpleNamespace(chunks=chunks, reference_engine=reference_engine, request=request)
