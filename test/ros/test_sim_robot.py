"""The demo's simulated robot sends the world's camera frames so that, through the
prefill node's converter, the model sees exactly what `eval world` feeds it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from embodied_kv.ros.image import message_to_input  # noqa: E402
from embodied_kv.ros.sim_robot import jpeg_image, rgb8_image  # noqa: E402
from embodied_kv.world.render import CAMERAS, observation_images  # noqa: E402
from embodied_kv.world.sim import WorldSim  # noqa: E402

SIZE = 64  # the world preset's image size


def test_world_frames_reach_the_model_as_eval_feeds_them():
    sim = WorldSim(seed=11)
    want = torch.from_numpy(observation_images(sim.scene, SIZE))  # [2, 3, S, S]
    for i, camera in enumerate(CAMERAS):
        got = message_to_input(rgb8_image(sim.image(camera, SIZE)), SIZE)
        # (x / 255 - 0.5) / 0.5 vs x / 255 * 2 - 1: equal up to float32 rounding
        torch.testing.assert_close(got, want[i], atol=1e-6, rtol=0)
        lossy = message_to_input(jpeg_image(sim.image(camera, SIZE)), SIZE)
        assert lossy.shape == want[i].shape and (lossy - want[i]).abs().mean() < 0.05
