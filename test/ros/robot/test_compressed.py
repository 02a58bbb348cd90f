"""sensor_msgs/CompressedImage through the prefill node: the robot's wrist camera is
`wrist::compressed` (conftest CONFIG). A frame sent as png or jpeg must reach the model
as the pixels Pillow decodes: the first chunk of an episode equals, byte for byte, the
chunk an engine in this process computes from the decoded pixels."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.model.vla import Observation
from embodied_kv.ros.image import compressed_to_rgb, rgb_to_input
from embodied_kv.srv import Reset

JOINTS = [f"joint_{i}" for i in range(1, 8)] + ["gripper"]
INSTRUCTION = "put the cup on the shelf"


@pytest.fixture(scope="module")
def local_engine():
    """The robot's engine, built here from the same parameters (tiny, seed 0)."""
    return Engine(EngineConfig(preset="tiny", device="cpu", seed=0))


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_compressed_frames_reach_the_model_as_decoded(robot, local_engine, image_files, fmt):
    encode, _ = image_files
    rng = np.random.default_rng(42)
    front = rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    wrist = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    wrist_msg = CompressedImage(format=f"rgb8; {fmt} compressed rgb8",
                                data=encode(wrist, fmt, quality=85) if fmt == "jpeg"
                                else encode(wrist, fmt))  # fmt: skip
    positions = np.linspace(-0.9, 0.8, len(JOINTS))
    for _ in range(3):  # latest wins; repeated so that nothing is lost in discovery
        robot.publish("front", Image(height=30, width=50, encoding="rgb8", step=150,
                                     data=front.tobytes()))  # fmt: skip
        robot.publish("wrist", wrist_msg)
        robot.publish("joint_states", JointState(name=JOINTS, position=positions.tolist()))
        robot.publish("instruction", String(data=INSTRUCTION))
        time.sleep(0.1)
    time.sleep(0.3)  # the converter thread has delivered the frames
    response = robot.call("reset", Reset.Request())
    assert response.success, response.message
    got = robot.first_chunk_after(time.monotonic())

    decoded = compressed_to_rgb(wrist_msg)  # what Pillow makes of it, here as there
    if fmt == "png":
        assert np.array_equal(decoded, wrist)  # lossless
    size = local_engine.model.cfg.vision.image_size
    images = torch.stack([rgb_to_input(front, size), rgb_to_input(decoded, size)])
    local_engine.observe(Observation(images, positions, INSTRUCTION))
    local_engine.begin_episode()
    expected = local_engine.cycle(0).chunk
    assert got == expected.tobytes()
