"""The `prefill` node: camera images, instruction and joint states in.

Subscribes `camera/<name>/image_raw` (sensor_msgs/Image, or sensor_msgs/CompressedImage
on `.../image_raw/compressed` for a camera marked `:compressed`), `instruction`
(std_msgs/String) and `joint_states` (sensor_msgs/JointState), converts them and keeps
the latest of each in an ObservationBuffer; each engine cycle hands the latest
Observation to `engine.observe` and prefills it once for every task of that frame
(docs/oxygen.md: the shared prefill). Camera frames are size-checked in the callback and
converted on the ImageConverter thread (image_worker.py). Bad input is rejected with a
logged reason and changes nothing; input that arrives while the node is inactive is
ignored. The state is the positions of `joint_names`, in robot units: the engine
normalises it (model/action_space.py). The node also serves the action `~/execute`
(ros/execute.py): a task as a goal.
"""

from __future__ import annotations

import dataclasses
import math

from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from embodied_kv.ros.execute import ExecuteServer
from embodied_kv.ros.image import ImageLimits, check_header, message_to_input
from embodied_kv.ros.image_worker import ImageConverter
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import excerpt
from embodied_kv.ros.observation import ObservationBuffer

DEFAULT_CAMERAS = ["front", "wrist"]
DEFAULT_JOINTS = [f"joint_{i}" for i in range(1, 8)] + ["gripper"]


COMPRESSED = "compressed"
LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(ImageLimits))


def camera_topic(entry: str) -> tuple[str, str, bool]:
    """A `cameras` entry -> (name, topic, compressed):

    'name'                 -> camera/name/image_raw, sensor_msgs/Image
    'name:topic'           -> topic, sensor_msgs/Image
    'name::compressed'     -> camera/name/image_raw/compressed, sensor_msgs/CompressedImage
    'name:topic:compressed' -> topic, sensor_msgs/CompressedImage"""
    name, _, rest = entry.partition(":")
    topic, _, kind = rest.partition(":")
    if not name:
        raise ValueError(f"camera entry {entry!r} has no name")
    if kind not in ("", COMPRESSED):
        raise ValueError(f"camera entry {entry!r}: the third field may only be '{COMPRESSED}'")
    compressed = kind == COMPRESSED
    default = f"camera/{name}/image_raw" + ("/compressed" if compressed else "")
    return name, topic or default, compressed


class PrefillNode(EmbodiedNode):
    NAME = "prefill"

    def __init__(self, **kwargs) -> None:
        self.buffer: ObservationBuffer | None = None
        self.converter: ImageConverter | None = None
        self.execute: ExecuteServer | None = None
        self.limits = ImageLimits()
        self._subs: list = []
        self._joints: list[str] = []
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("cameras", DEFAULT_CAMERAS)  # see camera_topic
        self.declare_parameter("joint_names", DEFAULT_JOINTS)  # state order in joint_states
        self.declare_parameter("max_instruction_chars", 400)
        defaults = ImageLimits()
        for key in LIMIT_KEYS:  # image.max_width, ...: frames refused before decoding
            self.declare_parameter(f"image.{key}", getattr(defaults, key))

    def setup(self) -> None:
        cameras = [camera_topic(e) for e in self.param("cameras")]
        cfg = self.engine.model.cfg
        self.limits = ImageLimits(**{k: int(self.param(f"image.{k}")) for k in LIMIT_KEYS})
        state_dim = self.engine.robot.state_dim
        self._joints = list(self.param("joint_names"))
        if self._joints and len(self._joints) < state_dim:
            raise ValueError(
                f"joint_names has {len(self._joints)} names, the robot state has {state_dim}"
            )
        self.buffer = ObservationBuffer(
            cfg.num_cameras, cfg.vision.image_size, state_dim, len(cameras)
        )
        size = self.buffer.image_size
        self.converter = ImageConverter(
            lambda msg: message_to_input(msg, size, self.limits), self.buffer.set_image,
            self.reject,
        )  # fmt: skip
        for index, (name, topic, compressed) in enumerate(cameras):
            self._subs.append(
                self.create_subscription(
                    CompressedImage if compressed else Image,
                    topic,
                    lambda msg, i=index, n=name: self._on_image(i, n, msg),
                    qos_profile_sensor_data,
                )
            )
        self._subs.append(self.create_subscription(String, "instruction", self._on_instruction, 10))
        self._subs.append(
            self.create_subscription(
                JointState, "joint_states", self._on_joint_states, qos_profile_sensor_data
            )
        )
        self.host.observation = self.buffer.observation
        self.host.observed_ns = self.buffer.state_stamp_ns
        limit = self.param("max_instruction_chars")
        self.execute = ExecuteServer(self, self._set_instruction, limit)
        listed = ", ".join(f"{n} <- {t}" + (" (compressed)" if c else "") for n, t, c in cameras)
        self.get_logger().info(
            f"cameras {listed}; model input {cfg.num_cameras} x {cfg.vision.image_size}px; "
            f"state: {state_dim} of joint_names"
        )

    def start(self) -> None:
        self.converter.start()
        self.execute.start()

    def stop(self) -> None:
        self.execute.stop()
        self.converter.stop()

    def teardown(self) -> None:
        if self.execute is not None:
            self.execute.destroy()
        self.execute = None
        if self.converter is not None:
            self.converter.stop()
        self.converter = None
        self.host.observation = lambda: None
        self.host.observed_ns = lambda: 0
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs.clear()
        self.buffer = None

    # -- callbacks -------------------------------------------------------------------

    def _on_image(self, index: int, name: str, msg: Image | CompressedImage) -> None:
        """Header checks here (no pixel touched); the conversion on the converter thread."""
        if not self.active:
            return
        try:
            check_header(msg, self.limits)
        except ValueError as e:
            self.reject("image", f"camera {name}: {e}; frame skipped")
            return
        self.converter.submit(index, name, msg)

    def _on_instruction(self, msg: String) -> None:
        if not self.active:
            return
        keep = "; the previous one stays"
        if self.too_long("instruction", "instruction", msg.data, "max_instruction_chars", keep):
            return
        text = msg.data.strip()
        if not text:
            self.reject("instruction", "empty instruction; the previous one stays")
        else:
            self._set_instruction(text)
            self.get_logger().info(f"instruction: {excerpt(text)}")

    def _set_instruction(self, text: str) -> None:
        """The instruction and its arrival on the node's clock (the clock of the
        joint_states stamps: ROS time, simulated or not)."""
        self.buffer.set_instruction(text, self.get_clock().now().nanoseconds)

    def _on_joint_states(self, msg: JointState) -> None:
        if not self.active:
            return
        try:
            state = self._state_of(msg)
        except ValueError as e:
            self.reject("joint_states", str(e))
            return
        stamp = msg.header.stamp
        self.buffer.set_state(state, stamp.sec * 10**9 + stamp.nanosec)

    def _state_of(self, msg: JointState) -> list[float]:
        """Positions in joint_names order when the message names its joints, else as sent."""
        positions = list(msg.position)
        if msg.name and self._joints:
            if len(msg.name) != len(positions):
                raise ValueError(f"{len(msg.name)} names but {len(positions)} positions")
            index = {n: i for i, n in enumerate(msg.name)}
            missing = [j for j in self._joints if j not in index]
            if missing:
                raise ValueError(f"joint_states lacks {missing}")
            positions = [positions[index[j]] for j in self._joints]
        if len(positions) < self.buffer.state_dim:
            raise ValueError(
                f"joint_states with {len(positions)} positions, the robot state has "
                f"{self.buffer.state_dim}"
            )
        if not all(math.isfinite(p) for p in positions):
            raise ValueError("joint_states with a non-finite position")
        return positions
