"""The observation dicts openpi's examples send -> the engine's Observation.

Keys and conversions follow openpi's input transforms (src/openpi/policies/):

    libero  libero_policy.LiberoInputs: observation/image, observation/wrist_image,
            observation/state, prompt
    droid   droid_policy.DroidInputs: observation/exterior_image_1_left,
            observation/wrist_image_left, observation/joint_position ++
            observation/gripper_position (a scalar gripper becomes [1]), prompt
    aloha   aloha_policy.AlohaInputs: images/{cam_high, cam_left_wrist, cam_right_wrist}
            (cam_low is accepted and unused, as openpi does), state, prompt

Cameras go to the model in openpi's order (base_0_rgb, left_wrist_0_rgb,
right_wrist_0_rgb); a model with fewer cameras takes the first ones, an absent optional
camera is masked. Images: uint8 or float in [0, 1] (openpi: x 255 -> uint8), HWC or CHW
(openpi: a leading 3 is CHW), any size: the Observation carries them as CameraFrames,
resized with padding to the model's S by the model on its device inside the cycle, with
the robot's own function on a CPU (model/camera_frames.py, model/image_input.py). State:
robot units, the robot's state_dim values, finite. ALOHA's `adapt_to_pi` joint flips and
gripper conversion are a property of openpi's ALOHA checkpoints, not of the layout: not
applied (docs/serve.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embodied_kv.model.camera_frames import CameraFrames
from embodied_kv.model.vla import Observation

MAX_SIDE = 4096  # pixels: the robot's default image.max_width / max_height (config/robot.yaml)


@dataclass(frozen=True)
class Layout:
    name: str
    cameras: tuple[tuple[str, ...], ...]  # key paths, openpi's camera order
    required: int  # the first `required` cameras must be sent
    state: tuple[tuple[str, ...], ...]  # key paths concatenated into the state
    ignored: tuple[tuple[str, ...], ...] = ()  # accepted and unused (openpi drops them)

    def camera_names(self, num_cameras: int) -> list[str]:
        return ["/".join(path) for path in self.cameras[:num_cameras]]


LAYOUTS: dict[str, Layout] = {
    "libero": Layout(
        "libero",
        cameras=(("observation/image",), ("observation/wrist_image",)),
        required=2,
        state=(("observation/state",),),
    ),
    "droid": Layout(
        "droid",
        cameras=(("observation/exterior_image_1_left",), ("observation/wrist_image_left",)),
        required=2,
        state=(("observation/joint_position",), ("observation/gripper_position",)),
    ),
    "aloha": Layout(
        "aloha",
        cameras=(
            ("images", "cam_high"),
            ("images", "cam_left_wrist"),
            ("images", "cam_right_wrist"),
        ),  # fmt: skip
        required=1,
        state=(("state",),),
        ignored=(("images", "cam_low"),),
    ),
}


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r}: use one of {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def has_observation(layout: Layout, msg: dict) -> bool:
    """Whether the frame carries an observation at all (else: a command only)."""
    return any(_get(msg, path) is not None for path in layout.cameras + layout.state)


def observation(
    layout: Layout, msg: dict, num_cameras: int, size: int, state_dim: int, max_prompt: int
) -> Observation:
    """A request's observation in robot units; ValueError naming the key that is wrong."""
    _check_image_keys(layout, msg)
    rgbs = []
    for i in range(num_cameras):
        path = layout.cameras[i] if i < len(layout.cameras) else None
        raw = None if path is None else _get(msg, path)
        if raw is None and path is not None and i < layout.required:
            raise ValueError(f"{layout.name}: missing camera {'/'.join(path)!r}")
        rgbs.append(None if raw is None else _rgb(raw, "/".join(path)))
    state = _state(layout, msg, state_dim)
    prompt = _prompt(msg, max_prompt)
    try:  # converted by the model inside the cycle (camera frames -> chunk)
        frames = CameraFrames(rgbs, size)
    except ValueError as e:
        raise ValueError(f"{layout.name}: {e}") from None
    present = tuple(rgb is not None for rgb in rgbs)
    return Observation(frames, state, prompt, None if all(present) else present)


def _get(msg: dict, path: tuple[str, ...]):
    node = msg
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _check_image_keys(layout: Layout, msg: dict) -> None:
    """openpi AlohaInputs refuses cameras it does not know; so do we, for nested ones."""
    nested = {p[0] for p in layout.cameras if len(p) > 1}
    known = {p[1] for p in layout.cameras + layout.ignored if len(p) > 1}
    for key in nested:
        group = msg.get(key)
        if group is None:
            continue
        if not isinstance(group, dict):
            raise ValueError(f"{layout.name}: {key!r} must be a map of camera images")
        extra = sorted(str(k) for k in group if k not in known)
        if extra:
            raise ValueError(f"{layout.name}: unknown cameras {extra} in {key!r}; "
                             f"known: {sorted(known)}")  # fmt: skip


def _rgb(raw, name: str) -> np.ndarray:
    """[H, W, 3] uint8 of an image sent as uint8 or float [0, 1], HWC or CHW."""
    if not isinstance(raw, np.ndarray):
        raise ValueError(f"camera {name!r}: expected an image array, got {type(raw).__name__}")
    if raw.ndim != 3 or 3 not in (raw.shape[0], raw.shape[-1]):
        raise ValueError(f"camera {name!r}: shape {raw.shape}, expected [H, W, 3] or [3, H, W]")
    kind = raw.dtype.kind  # (np.issubdtype costs several times this on every frame)
    if kind == "f":
        if not np.isfinite(raw).all():
            raise ValueError(f"camera {name!r}: image holds NaN or inf")
        raw = (255 * raw).astype(np.uint8)  # openpi _parse_image
    elif raw.dtype != np.uint8:
        raise ValueError(f"camera {name!r}: dtype {raw.dtype}, expected uint8 or float")
    if raw.shape[0] == 3:  # openpi: a leading 3 is CHW
        raw = raw.transpose(1, 2, 0)
    h, w, _ = raw.shape
    if not (1 <= h <= MAX_SIDE and 1 <= w <= MAX_SIDE):
        raise ValueError(f"camera {name!r}: {w}x{h} pixels, each side 1..{MAX_SIDE}")
    return raw


def _state(layout: Layout, msg: dict, state_dim: int) -> np.ndarray:
    parts = []
    for path in layout.state:
        raw = _get(msg, path)
        name = "/".join(path)
        if raw is None:
            raise ValueError(f"{layout.name}: missing {name!r}")
        try:
            value = np.asarray(raw, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{name!r} is not numbers: {type(raw).__name__}") from None
        if value.ndim > 1:
            raise ValueError(f"{name!r}: shape {value.shape}, expected a vector")
        parts.append(value.reshape(-1))  # a scalar gripper becomes [1] (DroidInputs)
    state = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if state.shape[0] != state_dim:
        raise ValueError(f"{layout.name}: state has {state.shape[0]} values, the robot's "
                         f"state_dim is {state_dim}")  # fmt: skip
    # in Python: right after the engine's work a numpy reduction costs ~70 us, this ~15
    if not all(map(math.isfinite, state.tolist())):
        raise ValueError(f"{layout.name}: state holds NaN or inf: {state.tolist()}")
    return state


def _prompt(msg: dict, max_chars: int) -> str:
    text = msg.get("prompt", "")
    if isinstance(text, bytes):  # DroidInputs decodes bytes prompts
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("prompt is not UTF-8") from None
    if not isinstance(text, str):
        raise ValueError(f"prompt must be text, got {type(text).__name__}")
    if len(text) > max_chars:
        raise ValueError(f"prompt of {len(text)} characters > {max_chars}")
    return text
