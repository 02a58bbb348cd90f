"""The `action_expert` node: the control stream out.

Publishes `action` (std_msgs/Float64MultiArray, what a ros2_control forward command
controller takes) at control_rate_hz from a dedicated output thread, and every new
chunk on `action_chunk` (trajectory_msgs/JointTrajectory: header.stamp = the time of
the chunk's first tick, one point per tick). Its activation owns the control loop:
activate starts the engine's cycle thread and the output thread, deactivate stops
both and keeps every state (KV, requests, queue) for the next activate.
"""

from __future__ import annotations

import numpy as np
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.ros.action_output import ActionOutput
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import action_msg, chunk_msg
from embodied_kv.ros.prefill import DEFAULT_JOINTS

OUTPUT_NICE = -10  # the action output thread's nice value where permitted (thread_priority.py)


class ActionExpertNode(EmbodiedNode):
    NAME = "action_expert"

    def __init__(self, **kwargs) -> None:
        self.output: ActionOutput | None = None
        self.joint_names: list[str] = []
        self._action_pub = None
        self._chunk_pub = None
        self._action_msg: Float64MultiArray | None = None
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("joint_names", DEFAULT_JOINTS)  # one per action dimension
        # the output thread's nice value (ros/thread_priority.py); 0: the process's own
        self.declare_parameter("output_nice", OUTPUT_NICE)

    def setup(self) -> None:
        dim = self.engine.robot.action_dim  # the robot's commands, not the model's padding
        self.joint_names = list(self.param("joint_names"))
        if len(self.joint_names) != dim:
            raise ValueError(
                f"joint_names has {len(self.joint_names)} names, the robot acts on {dim} "
                "dimensions (robot.action_dim / the checkpoint's action statistics)"
            )
        self._action_pub = self.create_lifecycle_publisher(Float64MultiArray, "action", 10)
        self._chunk_pub = self.create_lifecycle_publisher(JointTrajectory, "action_chunk", 10)
        self._action_msg = action_msg(self.joint_names)
        nice = int(self.param("output_nice"))
        if not -20 <= nice <= 19:
            raise ValueError(f"output_nice must be in -20..19, got {nice}")
        self.output = ActionOutput(self.host.clock, self.engine.queue.pop, self._publish_action,
                                   self.get_logger().error, nice)  # fmt: skip
        self.host.output = self.output

    def teardown(self) -> None:
        if self.output is not None:
            self.output.stop()
        self.host.output = None
        self.host.unlisten(self.NAME)
        for pub in (self._action_pub, self._chunk_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._action_pub = self._chunk_pub = self.output = None

    def start(self) -> None:
        self.host.listen(self.NAME, self._publish_chunk)
        self.output.start()
        self.host.start_cycles()
        self.get_logger().info(
            f"control loop running: action at {self.host.cfg.control_hz:g} Hz, a chunk of "
            f"{self.engine.model.cfg.action_horizon} every {self.host.cfg.replan_every} ticks"
        )

    def stop(self) -> None:
        self.host.stop_cycles()
        self.output.stop()
        self.host.unlisten(self.NAME)

    # -- called from the output and the cycle threads -----------------------------------

    def _publish_action(self, action: np.ndarray, tick: int) -> None:
        self._action_msg.data = action.tolist()
        self._action_pub.publish(self._action_msg)

    def _publish_chunk(self, result: CycleResult, tick: int) -> None:
        if result.chunk is None:  # ar mode: the pipeline is still filling; or held
            return
        clock = self.host.clock
        if result.chunk_tick is not None:  # ar mode: the chunk starts at its observation
            tick = result.chunk_tick
        msg = chunk_msg(
            result.chunk, self.joint_names, clock.wall_ns(tick), clock.period_s, result.frame
        )
        self._chunk_pub.publish(msg)
