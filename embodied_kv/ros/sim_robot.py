"""A simulated robot for `make demo` and the tests: what a real one would publish.

Synthetic camera frames (rgb8, or jpeg for a camera configured `:compressed`, a pattern
that drifts with time, at the camera's own resolution so the converter resizes them)
and joint states on timers, plus one-shot
publishers for the instruction, questions, memory updates and plan requests.
"""

from __future__ import annotations

import io
import time

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Header, String

from embodied_kv.msg import MemoryUpdate

MATCH_TIMEOUT_S = 15.0


def rgb8_image(rgb: np.ndarray, frame_id: str = "") -> Image:
    """[H, W, 3] uint8 -> sensor_msgs/Image (rgb8)."""
    h, w, _ = rgb.shape
    return Image(
        height=h, width=w, encoding="rgb8", step=3 * w, data=rgb.tobytes(),
        header=_header(frame_id),
    )  # fmt: skip


def jpeg_image(rgb: np.ndarray) -> CompressedImage:
    """[H, W, 3] uint8 -> sensor_msgs/CompressedImage, as image_transport's jpeg publisher."""
    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.fromarray(rgb).save(out, format="JPEG", quality=90)
    return CompressedImage(header=_header(), format="rgb8; jpeg compressed rgb8",
                           data=out.getvalue())  # fmt: skip


def pattern(h: int, w: int, t: float, phase: float) -> np.ndarray:
    """A smooth colour pattern that drifts with time t (s): [H, W, 3] uint8."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    r = 127.5 * (1 + np.sin(x / 9.0 + t + phase))
    g = 127.5 * (1 + np.sin(y / 7.0 - 0.7 * t))
    b = 127.5 * (1 + np.sin((x + y) / 13.0 + 0.3 * t + phase))
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


def _header(frame_id: str = "") -> Header:
    ns = time.time_ns()
    return Header(stamp=Time(sec=ns // 10**9, nanosec=ns % 10**9), frame_id=frame_id)


class SimRobot:
    """Publishes from `node` (which must be spun by an executor) into the robot's topics."""

    def __init__(
        self,
        node: Node,
        cameras: list[tuple[str, bool]],  # (topic, compressed)
        joint_names: list[str],
        image_hw: tuple[int, int] = (96, 128),
        camera_hz: float = 15.0,
        joints_hz: float = 25.0,
    ):
        self.node, self.joint_names, self.image_hw = node, joint_names, image_hw
        self._t0 = time.monotonic()
        self._cams = [
            (node.create_publisher(CompressedImage if c else Image, t, qos_profile_sensor_data), c)
            for t, c in cameras
        ]
        self._joints = node.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.instruction = node.create_publisher(String, "instruction", 10)
        self.question = node.create_publisher(String, "question", 10)
        self.memory = node.create_publisher(MemoryUpdate, "memory/update", 10)
        self.plan_request = node.create_publisher(String, "plan_request", 10)
        self._timers = [
            node.create_timer(1.0 / camera_hz, self._publish_frames),
            node.create_timer(1.0 / joints_hz, self._publish_joints),
        ]

    def _publish_frames(self) -> None:
        t = time.monotonic() - self._t0
        for i, (pub, compressed) in enumerate(self._cams):
            rgb = pattern(*self.image_hw, t, phase=1.3 * i)
            pub.publish(jpeg_image(rgb) if compressed else rgb8_image(rgb))

    def _publish_joints(self) -> None:
        t = time.monotonic() - self._t0
        n = len(self.joint_names)
        positions = [0.5 * np.sin(0.8 * t + 0.4 * j) for j in range(n)]
        self._joints.publish(
            JointState(header=_header(), name=self.joint_names, position=positions)
        )

    def say(self, publisher, msg) -> None:
        """One-shot publish once the robot subscribes (a message sent before the
        subscription is matched would be lost)."""
        deadline = time.monotonic() + MATCH_TIMEOUT_S
        while publisher.get_subscription_count() == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nobody subscribes {publisher.topic_name}")
            time.sleep(0.02)
        publisher.publish(msg)

    def instruct(self, text: str) -> None:
        self.say(self.instruction, String(data=text))

    def ask(self, text: str) -> None:
        self.say(self.question, String(data=text))

    def remember(self, segment_id: str, text: str = "", op: int = MemoryUpdate.OP_ADD) -> None:
        self.say(self.memory, MemoryUpdate(stamp=_header().stamp, segment_id=segment_id,
                                           operation=op, text=text))  # fmt: skip

    def plan(self, goal: str) -> None:
        self.say(self.plan_request, String(data=goal))

    def close(self) -> None:
        for timer in self._timers:
            self.node.destroy_timer(timer)
