"""A simulated robot for `make demo`: what a real one would publish, from the numpy
tabletop world (world/sim.py).

Camera frames (the world's cameras rendered at the model's image size: rgb8, or jpeg for
a camera configured `:compressed`) and joint states (the arm's state vector) on timers;
the `action` topic applied to the scene, one `Scene.step` per action received; a new
episode's instruction published when the last one ends. One-shot publishers for
questions, memory updates and plan requests. Every callback runs on the demo's one
executor thread; the lock guards the world against the demo script's reads.
"""

from __future__ import annotations

import io
import threading
import time

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray, Header, String

from embodied_kv.msg import MemoryUpdate
from embodied_kv.world.sim import WorldSim, camera_of

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


def _header(frame_id: str = "") -> Header:
    ns = time.time_ns()
    return Header(stamp=Time(sec=ns // 10**9, nanosec=ns % 10**9), frame_id=frame_id)


class SimRobot:
    """Publishes from `node` (which must be spun by an executor) into the robot's topics."""

    def __init__(
        self,
        node: Node,
        world: WorldSim,
        cameras: list[tuple[str, str, bool]],  # (name, topic, compressed)
        joint_names: list[str],
        image_size: int,  # the model's: frames need no resize
        camera_hz: float = 15.0,
        joints_hz: float = 25.0,
    ):
        self.node, self.world, self.joint_names = node, world, joint_names
        self.image_size = image_size
        self.lock = threading.Lock()
        self.rejected_actions = 0
        self.episode_began = time.monotonic()
        self._cams = [
            (
                node.create_publisher(CompressedImage if c else Image, t, qos_profile_sensor_data),
                camera_of(name, i),
                c,
            )
            for i, (name, t, c) in enumerate(cameras)
        ]
        self._joints = node.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.instruction = node.create_publisher(String, "instruction", 10)
        self.question = node.create_publisher(String, "question", 10)
        self.memory = node.create_publisher(MemoryUpdate, "memory/update", 10)
        self.plan_request = node.create_publisher(String, "plan_request", 10)
        self._action = node.create_subscription(Float64MultiArray, "action", self._on_action, 100)
        self._timers = [
            node.create_timer(1.0 / camera_hz, self._publish_frames),
            node.create_timer(1.0 / joints_hz, self._publish_joints),
        ]

    def _publish_frames(self) -> None:
        with self.lock:
            frames = [(pub, self.world.image(cam, self.image_size), c)
                      for pub, cam, c in self._cams]  # fmt: skip
        for pub, rgb, compressed in frames:
            pub.publish(jpeg_image(rgb) if compressed else rgb8_image(rgb))

    def _publish_joints(self) -> None:
        with self.lock:
            state = self.world.state()
        n = len(self.joint_names)
        positions = [float(state[j]) if j < len(state) else 0.0 for j in range(n)]
        self._joints.publish(
            JointState(header=_header(), name=self.joint_names, position=positions)
        )

    def _on_action(self, msg: Float64MultiArray) -> None:
        try:
            with self.lock:
                new_episode = self.world.apply(msg.data)
                text = self.world.instruction
        except ValueError:
            self.rejected_actions += 1
            return
        if new_episode:
            self.instruction.publish(String(data=text))
            with self.lock:
                self.episode_began = time.monotonic()

    def next_episode(self, timeout_s: float) -> bool:
        """Wait until a new episode begins (False after timeout_s): a question asked early
        in an episode is answered from a frame of the same scene."""
        with self.lock:
            began = self.episode_began
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.episode_began != began:
                    return True
            time.sleep(0.01)
        return False

    def start_episode(self) -> None:
        """Publish the current episode's instruction (once the robot subscribes)."""
        with self.lock:
            text = self.world.instruction
        self.instruct(text)

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
        self.node.destroy_subscription(self._action)
