"""The `prefill` node: camera images, instruction and joint states in.

Subscribes `camera/<name>/image_raw` (sensor_msgs/Image, one per configured camera),
`instruction` (std_msgs/String) and `joint_states` (sensor_msgs/JointState), converts
them and keeps the latest of each in an ObservationBuffer; each engine cycle hands
the latest Observation to `engine.observe` and prefills it once for every task of
that frame (DESIGN §5; OxyGen shared prefill). Bad input is rejected with a logged
reason and changes nothing; input that arrives while the node is inactive is ignored.
"""

from __future__ import annotations

import math

from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from embodied_kv.ros.image import image_to_input
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.observation import ObservationBuffer

DEFAULT_CAMERAS = ["front", "wrist"]
DEFAULT_JOINTS = [f"joint_{i}" for i in range(1, 8)] + ["gripper"]


def camera_topic(entry: str) -> tuple[str, str]:
    """'name' -> (name, 'camera/name/image_raw'); 'name:topic' -> (name, topic)."""
    name, _, topic = entry.partition(":")
    if not name:
        raise ValueError(f"camera entry {entry!r} has no name")
    return name, topic or f"camera/{name}/image_raw"


class PrefillNode(EmbodiedNode):
    NAME = "prefill"

    def __init__(self, **kwargs) -> None:
        self.buffer: ObservationBuffer | None = None
        self._subs: list = []
        self._joints: list[str] = []
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("cameras", DEFAULT_CAMERAS)  # 'name' or 'name:topic'
        self.declare_parameter("joint_names", DEFAULT_JOINTS)  # state order in joint_states
        self.declare_parameter("max_instruction_chars", 400)

    def setup(self) -> None:
        cameras = [camera_topic(e) for e in self.param("cameras")]
        cfg = self.engine.model.cfg
        self.buffer = ObservationBuffer(
            cfg.num_cameras, cfg.vision.image_size, cfg.state_dim, len(cameras)
        )
        self._joints = list(self.param("joint_names"))
        for index, (name, topic) in enumerate(cameras):
            self._subs.append(
                self.create_subscription(
                    Image,
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
        self.get_logger().info(
            f"cameras {', '.join(f'{n} <- {t}' for n, t in cameras)}; "
            f"model input {cfg.num_cameras} x {cfg.vision.image_size}px"
        )

    def teardown(self) -> None:
        self.host.observation = lambda: None
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs.clear()
        self.buffer = None

    # -- callbacks -------------------------------------------------------------------

    def _on_image(self, index: int, name: str, msg: Image) -> None:
        if not self.active:
            return
        try:
            image = image_to_input(msg, self.buffer.image_size)
        except ValueError as e:
            self.reject("image", f"camera {name}: {e}; frame skipped")
            return
        except Exception as e:
            self.reject("image", f"camera {name}: {type(e).__name__}: {e}; frame skipped")
            return
        self.buffer.set_image(index, image)

    def _on_instruction(self, msg: String) -> None:
        if not self.active:
            return
        text = msg.data.strip()
        limit = self.param("max_instruction_chars")
        if not text:
            self.reject("instruction", "empty instruction; the previous one stays")
        elif len(text) > limit:
            self.reject(
                "instruction",
                f"instruction of {len(text)} chars > max_instruction_chars={limit}; "
                "the previous one stays",
            )
        else:
            self.buffer.set_instruction(text)
            self.get_logger().info(f"instruction: {text!r}")

    def _on_joint_states(self, msg: JointState) -> None:
        if not self.active:
            return
        try:
            state = self._state_of(msg)
        except ValueError as e:
            self.reject("joint_states", str(e))
            return
        self.buffer.set_state(state)

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
        if not positions:
            raise ValueError("joint_states without positions")
        if not all(math.isfinite(p) for p in positions):
            raise ValueError("joint_states with a non-finite position")
        return positions
