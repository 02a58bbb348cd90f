"""The engine's own capsule section: the frame, the instruction and the latest
observation (docs/ARCHITECTURE.md: what the next cycle would prefill is session state)."""

from __future__ import annotations

import numpy as np
import torch

from embodied_kv.model.camera_frames import CameraFrames
from embodied_kv.model.config import ModelConfig
from embodied_kv.model.vla import Observation


def observation_tensors(obs: Observation | None, device: torch.device) -> dict[str, torch.Tensor]:
    if obs is None:
        return {}
    images = obs.images  # camera frames: converted on the model's device, as its prefill
    if isinstance(images, CameraFrames):
        images = images.tensor(device)
    else:
        images = images.detach().clone()
    out = {
        "images": images,  # [num_cameras, 3, S, S]
        "state": torch.from_numpy(np.asarray(obs.state, dtype=np.float64).copy()),  # [<= D]
    }
    if obs.robot_state is not None:  # [S] robot units: what delta actions add to
        out["robot_state"] = torch.from_numpy(np.asarray(obs.robot_state, np.float64).copy())
    return out


def observation_meta(obs: Observation | None) -> dict | None:
    if obs is None:
        return None
    mask = None if obs.camera_mask is None else list(obs.camera_mask)
    return {"instruction": obs.instruction, "camera_mask": mask}


def check_observation(cfg: ModelConfig, tensors: dict, meta: dict | None) -> None:
    if meta is None:
        return
    s = cfg.vision.image_size
    images = tensors.get("images")
    shape = None if images is None else tuple(images.shape)
    if shape != (cfg.num_cameras, 3, s, s):
        raise ValueError(f"engine section: images {shape} != {(cfg.num_cameras, 3, s, s)}")
    if "state" not in tensors or not isinstance(meta.get("instruction"), str):
        raise ValueError("engine section: observation without its state or instruction")


def load_observation(tensors: dict, meta: dict | None) -> Observation | None:
    if meta is None:
        return None
    mask = meta["camera_mask"]
    robot_state = tensors.get("robot_state")
    # a GPU-tier capsule holds its tensors on the device: the observation is host data
    return Observation(
        tensors["images"].to("cpu", copy=True),
        tensors["state"].cpu().numpy().copy(),
        meta["instruction"],
        None if mask is None else tuple(mask),
        None if robot_state is None else robot_state.cpu().numpy().copy(),
    )
