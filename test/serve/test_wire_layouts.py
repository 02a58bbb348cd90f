"""The frame format against openpi-client's own msgpack_numpy, and the layouts' key
mapping and refusals, in-process (no server)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from openpi_client import msgpack_numpy

from embodied_kv.model.image_input import rgb_to_input
from embodied_kv.serve import wire
from embodied_kv.serve.config import ServeConfig, serve_config
from embodied_kv.serve.layouts import get_layout, has_observation, observation
from embodied_kv.serve.session import Session

S, STATE = 32, 8


def img(seed: int, h: int = 48, w: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_frames_are_openpi_client_frames_both_ways():
    obs = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "s": np.float64(2.5),
           "n": {"u8": img(0)}, "prompt": "pick"}  # fmt: skip
    assert wire.pack(obs) == msgpack_numpy.packb(obs)
    back = wire.unpack(msgpack_numpy.packb(obs))
    assert back["a"].dtype == np.float32 and np.array_equal(back["a"], obs["a"])
    assert np.array_equal(back["n"]["u8"], obs["n"]["u8"]) and back["s"] == 2.5
    reply = msgpack_numpy.unpackb(wire.pack({"actions": np.ones((10, 7))}))
    assert reply["actions"].shape == (10, 7)


def tagged(data: bytes, dtype: str, shape: list) -> bytes:
    """A frame with one array map as openpi tags it, its fields as given."""
    array = {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}
    return msgpack.packb({"x": array})


@pytest.mark.parametrize(
    "frame, error",
    [
        ("text", "text frame"),
        (b"\xc1", "not a request frame"),
        (msgpack.packb([1]), "msgpack map"),
        (tagged(b"abc", "<f4", [2]), "needs 8 bytes, got 3"),
        (tagged(b"", "|O", [0]), "refused"),
        (tagged(b"", "nope", [0]), "not a numpy dtype"),
        (tagged(b"", "<f4", [-1]), "not a list of sizes"),
    ],
)
def test_bad_frames_are_value_errors(frame, error):
    with pytest.raises(ValueError, match=error):
        wire.unpack(frame)


def test_pack_refuses_object_arrays():
    with pytest.raises(ValueError, match="dtype object"):
        wire.pack({"x": np.array([None])})


def test_droid_scalar_gripper_float_chw_images():
    a, b = img(1), img(2)
    msg = {"observation/exterior_image_1_left": a.transpose(2, 0, 1),  # CHW
           "observation/wrist_image_left": b.astype(np.float32) / 255.0,  # float [0, 1]
           "observation/joint_position": np.arange(7) / 10,
           "observation/gripper_position": np.float64(0.5),  # 0-d: openpi makes it [1]
           "prompt": b"stack the cups"}  # fmt: skip
    obs = observation(get_layout("droid"), msg, 2, S, STATE, 400)
    assert obs.state.tolist() == [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.5]
    assert obs.instruction == "stack the cups" and obs.camera_mask is None
    images = obs.images.tensor()  # the model converts them (camera_frames.py)
    assert torch.equal(images[0], rgb_to_input(a, S))
    back = (255 * (b.astype(np.float32) / 255.0)).astype(np.uint8)  # openpi's conversion
    assert torch.equal(images[1], rgb_to_input(back, S))


def test_aloha_optional_cameras_are_masked_and_unknown_ones_refused():
    chw = img(3).transpose(2, 0, 1)
    msg = {"images": {"cam_high": chw, "cam_low": chw}, "state": np.zeros(STATE)}
    obs = observation(get_layout("aloha"), msg, 3, S, STATE, 400)
    assert obs.camera_mask == (True, False, False)
    assert obs.images.frames[1] is None and obs.images.frames[2] is None
    assert torch.equal(obs.images.tensor()[1], torch.zeros(3, S, S)) and obs.instruction == ""
    msg["images"]["cam_top"] = chw
    with pytest.raises(ValueError, match="unknown cameras \\['cam_top'\\]"):
        observation(get_layout("aloha"), msg, 3, S, STATE, 400)


@pytest.mark.parametrize(
    "change, error",
    [
        ({"observation/wrist_image": None}, "missing camera 'observation/wrist_image'"),
        ({"observation/state": np.zeros(5)}, "state has 5 values, the robot's state_dim is 8"),
        ({"observation/state": np.array([np.inf] * 8)}, "NaN or inf"),
        ({"observation/state": "abc"}, "is not numbers"),
        ({"observation/image": np.zeros((4, 4, 3), np.int64)}, "dtype int64"),
        ({"observation/image": np.full((4, 4, 3), np.nan)}, "NaN or inf"),
        ({"observation/image": np.zeros((4, 4, 4), np.uint8)}, "shape \\(4, 4, 4\\)"),
        ({"observation/image": np.zeros((5000, 4, 3), np.uint8)}, "each side 1..4096"),
        ({"observation/image": [1, 2]}, "expected an image array"),
        ({"observation/image": np.zeros((1, 4096, 3), np.uint8)}, "resize to nothing"),
        ({"prompt": "x" * 401}, "401 characters > 400"),
        ({"prompt": b"\xff"}, "not UTF-8"),
    ],
)
def test_libero_refusals_name_the_key(change, error):
    msg = {"observation/image": img(4), "observation/wrist_image": img(5),
           "observation/state": np.zeros(STATE), "prompt": "go"}  # fmt: skip
    msg.update(change)
    msg = {k: v for k, v in msg.items() if v is not None}
    with pytest.raises(ValueError, match=error):
        observation(get_layout("libero"), msg, 2, S, STATE, 400)


def test_a_command_frame_carries_no_observation():
    layout = get_layout("libero")
    assert not has_observation(layout, {"command": "reset"})
    assert has_observation(layout, {"observation/state": np.zeros(2)})


def test_serve_config_checks_the_file_and_the_flags(tmp_path):
    from embodied_kv.config_file import load_params

    path = tmp_path / "robot.yaml"
    path.write_text("/**:\n  ros__parameters:\n    preset: tiny\n"
                    "serve:\n  ros__parameters:\n    layout: aloha\n    port: 9000\n")  # fmt: skip
    params = load_params(path)
    assert serve_config(params) == ServeConfig(layout="aloha", port=9000)
    assert serve_config(params, layout="droid", port=None).layout == "droid"
    with pytest.raises(ValueError, match="layout 'lerobot'"):
        serve_config(params, layout="lerobot")
    path.write_text("serve:\n  ros__parameters:\n    prot: 1\n")
    with pytest.raises(ValueError, match="no parameter \\['prot'\\]"):
        serve_config(load_params(path))
    path.write_text("serve:\n  ros__parameters:\n    port: '80'\n")
    with pytest.raises(ValueError, match="port='80' must be int"):
        serve_config(load_params(path))


def test_session_capsule_names_are_namespaced_and_checked():
    s = Session()
    assert s.capsule("start") == f"serve{s.id}.start"
    for bad in ("", "a b", 5):
        with pytest.raises(ValueError):
            s.capsule(bad)
