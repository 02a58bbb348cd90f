"""The demo's side of the wire: a simulated robot in the numpy tabletop world, a listener
on every output topic, the capsule service clients and the script that `make demo` plays:
episodes of the world's pick-and-place tasks back to back for the whole run, scene
questions and memory queries of the world (their true answers kept for the report), a
snapshot and a reset."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from embodied_kv.config_file import RobotParams
from embodied_kv.model.config import get_preset
from embodied_kv.msg import MemoryUpdate, TextChunk
from embodied_kv.ros.demo_report import Asked, Report
from embodied_kv.ros.prefill import DEFAULT_CAMERAS, DEFAULT_JOINTS, camera_topic
from embodied_kv.ros.rate_probe import RateProbe
from embodied_kv.ros.sim_robot import SimRobot
from embodied_kv.srv import ListCapsules, Reset, Snapshot
from embodied_kv.world import memory, questions
from embodied_kv.world.sim import WorldSim

SERVICE_TIMEOUT_S = 10.0
# held-out world seeds: above every training seed (train/config.py EVAL_SEED_BASE = 2**48)
# and apart from `eval world`'s items
DEMO_SEED = 2**48 + 9 * 10**6
EPISODE_WAIT_S = 2.0  # then ask anyway (an episode may run to its 200-action limit: 4 s)
SETTLE_S = 0.15  # the new scene's frames and instruction reach the engine first


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
        cameras = [camera_topic(e) for e in prefill.get("cameras", DEFAULT_CAMERAS)]
        size = get_preset(str(prefill.get("preset", "world"))).vision.image_size
        self.world = WorldSim(DEMO_SEED)
        joints = list(prefill.get("joint_names", DEFAULT_JOINTS))
        self.sim = SimRobot(self.node, self.world, cameras, joints, size)
        self.listener = Listener(self.node, 1.0 / self.rate_hz)
        self.snapshot = self.node.create_client(Snapshot, "kv_manager/snapshot")
        self.reset = self.node.create_client(Reset, "kv_manager/reset")
        self.list = self.node.create_client(ListCapsules, "kv_manager/list_capsules")
        self.rng = np.random.default_rng(DEMO_SEED)

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
        """The script over the world's episodes, which run back to back meanwhile;
        returns what was seen."""
        report = Report(target_hz=self.rate_hz, seconds=seconds)
        sim, t0 = self.sim, time.monotonic()
        facts: list[str] = []  # segment ids of the memory now

        def snapshot():
            r = self.call(self.snapshot, Snapshot.Request(name="demo_checkpoint", tier=1))
            report.snapshot = r.message if r.success else f"refused: {r.message}"

        def reset():
            sent = time.monotonic()
            r = self.call(self.reset, Reset.Request())
            report.reset_rtt_ms = 1e3 * (time.monotonic() - sent)
            report.reset = r
            report.reset_at = time.monotonic()

        def ask():
            """A question about the scene of an episode that has just begun (so the frame
            that answers it shows the same scene); its truth at asking."""
            if sim.next_episode(EPISODE_WAIT_S):
                time.sleep(SETTLE_S)
            with sim.lock:
                qa = questions.sample_question(self.world.scene, self.rng)
            report.questions.append(Asked(qa.question, qa.answer))
            sim.ask(qa.question)

        def remember(hops: int):
            """The memory becomes the facts of a new query (one fact per segment)."""
            for key in facts:
                sim.remember(key, op=MemoryUpdate.OP_REMOVE)
            mq = memory.sample_query(self.rng, hops)
            facts[:] = [f"fact-{hops}-{i}" for i in range(len(mq.facts))]
            for key, fact in zip(facts, mq.facts, strict=True):
                sim.remember(key, fact)
            report.goals.append(Asked(mq.query, mq.answer))

        def plan():
            sim.plan(report.goals[-1].text)

        script = [
            (0.0, "instruction", sim.start_episode),
            (0.2, "memory", lambda: remember(1)),
            (1.0, "question", ask),
            (3.0, "plan", plan),
            (6.0, "memory", lambda: remember(2)),
            (6.5, "question", ask),
            (8.0, "plan", plan),
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
        with sim.lock:
            report.episodes = list(self.world.results)
            report.episode_steps = self.world.steps
        report.rejected_actions = sim.rejected_actions
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
