"""The demo's side of the wire: a simulated robot, a listener on every output topic,
the capsule service clients and the scripted episode that `make demo` plays."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from embodied_kv.msg import MemoryUpdate, TextChunk
from embodied_kv.ros.demo_report import Report
from embodied_kv.ros.params import RobotParams
from embodied_kv.ros.prefill import DEFAULT_CAMERAS, DEFAULT_JOINTS, camera_topic
from embodied_kv.ros.rate_probe import RateProbe
from embodied_kv.ros.sim_robot import SimRobot
from embodied_kv.srv import ListCapsules, Reset, Snapshot

SERVICE_TIMEOUT_S = 10.0

QUESTIONS = ("what is on the table?", "which object is closest to the gripper?")
GOALS = ("put the red block in the bowl", "stack the blue cup on the red block")
MEMORY = (
    ("object/red_block", "red block at the left edge of the table"),
    ("object/bowl", "white bowl in the middle of the table"),
    ("object/blue_cup", "blue cup right of the bowl"),
)


class Listener:
    """Records everything the robot publishes."""

    def __init__(self, node, period_s: float):
        self.actions = RateProbe(period_s)
        self.chunks = 0
        self.text: dict[str, TextChunk] = {}  # request id -> its latest chunk
        self.pieces: dict[str, int] = defaultdict(int)  # request id -> chunks received
        self.diagnostics: DiagnosticArray | None = None
        self.peak_tokens_per_s = 0.0
        node.create_subscription(Float64MultiArray, "action", self._on_action, 100)
        node.create_subscription(JointTrajectory, "action_chunk", self._on_chunk, 10)
        node.create_subscription(TextChunk, "text", self._on_text, 100)
        node.create_subscription(TextChunk, "plan", self._on_text, 100)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)

    def _on_action(self, msg) -> None:
        self.actions.record()

    def _on_chunk(self, msg) -> None:
        self.chunks += 1

    def _on_text(self, msg: TextChunk) -> None:
        self.text[msg.request_id] = msg
        self.pieces[msg.request_id] += 1

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        for status in msg.status:
            if status.name == "embodied_kv: engine":
                self.diagnostics = msg
                values = {kv.key: kv.value for kv in status.values}
                rate = float(values.get("tokens_per_s", 0.0))
                self.peak_tokens_per_s = max(self.peak_tokens_per_s, rate)


class DemoWorld:
    def __init__(self, context, namespace: str, params: RobotParams):
        prefill = params.for_node("prefill")
        self.rate_hz = float(params.for_node("action_expert").get("control_rate_hz", 50.0))
        self.node = rclpy.create_node("demo_world", namespace=namespace, context=context)
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self._spin, name="demo-executor", daemon=True)
        self._spinner.start()
        cameras = [camera_topic(e)[1:] for e in prefill.get("cameras", DEFAULT_CAMERAS)]
        self.sim = SimRobot(self.node, cameras, list(prefill.get("joint_names", DEFAULT_JOINTS)))
        self.listener = Listener(self.node, 1.0 / self.rate_hz)
        self.snapshot = self.node.create_client(Snapshot, "kv_manager/snapshot")
        self.reset = self.node.create_client(Reset, "kv_manager/reset")
        self.list = self.node.create_client(ListCapsules, "kv_manager/list_capsules")

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def call(self, client, request):
        """The response, or a RuntimeError saying why there is none."""
        if not client.wait_for_service(timeout_sec=SERVICE_TIMEOUT_S):
            raise RuntimeError(f"{client.srv_name} is not available")
        future = client.call_async(request)
        deadline = time.monotonic() + SERVICE_TIMEOUT_S
        while not future.done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no answer from {client.srv_name}")
            time.sleep(0.002)
        return future.result()

    def play(self, seconds: float) -> Report:
        """The scripted episode; returns what was seen."""
        report = Report(target_hz=self.rate_hz, seconds=seconds)
        sim, t0 = self.sim, time.monotonic()

        def snapshot():
            r = self.call(self.snapshot, Snapshot.Request(name="demo_checkpoint", tier=1))
            report.snapshot = r.message if r.success else f"refused: {r.message}"

        def reset():
            sent = time.monotonic()
            r = self.call(self.reset, Reset.Request())
            report.reset_rtt_ms = 1e3 * (time.monotonic() - sent)
            report.reset = r
            report.reset_at = time.monotonic()

        script = [
            (0.0, "instruction", lambda: sim.instruct("pick up the red block")),
            *[(0.2, "memory", lambda k=k, v=v: sim.remember(k, v)) for k, v in MEMORY],
            (1.0, "question", lambda: sim.ask(QUESTIONS[0])),
            (3.0, "plan", lambda: sim.plan(GOALS[0])),
            (
                6.0,
                "memory",
                lambda: sim.remember(
                    MEMORY[0][0], "red block now in the bowl", MemoryUpdate.OP_UPDATE
                ),
            ),  # fmt: skip
            (6.5, "question", lambda: sim.ask(QUESTIONS[1])),
            (8.0, "plan", lambda: sim.plan(GOALS[1])),
            (min(10.0, 0.6 * seconds), "snapshot", snapshot),
            (max(seconds - 4.0, 0.8 * seconds), "reset", reset),
        ]
        for at, what, action in sorted(script, key=lambda s: s[0]):
            if at >= seconds:
                continue
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            try:
                action()
            except Exception as e:
                report.problems.append(f"{what}: {e}")
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        report.actions = self.listener.actions.summary(since=t0 + 1.0)
        if report.reset_at is not None:
            report.after_reset = self.listener.actions.count(since=report.reset_at)
            report.after_reset_s = time.monotonic() - report.reset_at
        report.chunks = self.listener.chunks
        report.text, report.pieces = dict(self.listener.text), dict(self.listener.pieces)
        report.questions, report.goals = QUESTIONS, GOALS
        report.diagnostics = self.listener.diagnostics
        report.peak_tokens_per_s = self.listener.peak_tokens_per_s
        try:
            report.capsules = self.call(self.list, ListCapsules.Request())
        except RuntimeError as e:
            report.problems.append(f"list_capsules: {e}")
        return report

    def close(self) -> None:
        self.sim.close()
        self.executor.shutdown()
        self._spinner.join(5.0)
        self.node.destroy_node()
