"""One robot process for the whole session, probed over DDS from this process.

`robot` spawns `python -m embodied_kv.ros.container` (all five nodes, one engine)
with a test YAML, in its own namespace, once per session; its ROS log goes to a
file the tests read. `probe` is this process's side: publishers of camera frames,
joint states, instruction, questions, memory updates and plan requests; recorders
of action, action_chunk, text, plan and /diagnostics; clients of the capsule and
lifecycle services. At the end of the session the robot gets SIGINT and must exit
0 after cleaning up every node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROS_SKIP_REASON = "rclpy is not importable (no ROS 2 here; `make test` installs it into .venv)"
pytest.importorskip("rclpy", reason=ROS_SKIP_REASON)

import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.action import ActionClient  # noqa: E402
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image, JointState  # noqa: E402
from std_msgs.msg import Float64MultiArray, String  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from embodied_kv.action import Execute  # noqa: E402
from embodied_kv.msg import MemoryUpdate, TextChunk  # noqa: E402
from embodied_kv.ros.container import NODE_CLASSES  # noqa: E402
from embodied_kv.ros.rate_probe import RateProbe  # noqa: E402
from embodied_kv.srv import ListCapsules, Reset, Rollback, Snapshot  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "/robot_under_test"
RATE_HZ = 50.0
JOINTS = [f"joint_{i}" for i in range(1, 8)] + ["gripper"]
STARTUP_TIMEOUT_S = 90.0  # interpreter + torch + rclpy imports, engine build, on a busy machine
TIMEOUT_S = 15.0
EXIT_TIMEOUT_S = 30.0
FOREIGN = "foreign"  # a disk capsule taken with another engine config
WRIST_TOPIC = "camera/wrist/image_raw/compressed"  # the default topic of 'wrist::compressed'
EARLIER = "earlier"  # a disk capsule of an earlier robot process, answers live in it
EARLIER_ANSWERS = 6

CONFIG = f"""
/**:
  ros__parameters:
    autostart: true
    preset: tiny
    device: cpu
    seed: 0
    control_rate_hz: {RATE_HZ}
    replan_every: 5
    joint_names: [{", ".join(JOINTS)}]
    language: {{narrate_every: 0, answer_tokens: 48, max_decode_steps: 6}}
    capsules: {{disk_dir: "{{disk}}", history: 8}}
    memory: {{mode: keep, keep_min_segments: 0}}  # KEEP (opt-in) through the ROS nodes
prefill:
  ros__parameters:
    cameras: [front, "wrist::compressed"]  # wrist: CompressedImage on .../image_raw/compressed
    max_instruction_chars: 200
    image: {{max_width: 4096, max_height: 4096, max_pixels: 16777216, max_bytes: 30000}}
kv_manager:
  ros__parameters:
    diagnostics_period_s: 0.5
"""


class Robot:
    """The spawned robot process and its log."""

    def __init__(self, workdir: Path, config: str = CONFIG, namespace: str = NAMESPACE):
        self.disk = workdir / "capsules"
        self.config = workdir / "robot.yaml"
        self.config.write_text(config.replace("{disk}", str(self.disk)))
        self.namespace = namespace
        self.log_path = workdir / "robot.log"
        self.out_path = workdir / "robot.out"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "embodied_kv.ros.container", "--config", str(self.config),
             "--ros-args", "-r", f"__ns:={namespace}"],
            cwd=ROOT, env=env, stdout=open(self.out_path, "w"), stderr=open(self.log_path, "w"),
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> int:
        """Ctrl-C as `ros2 launch` escalates it: SIGINT, SIGINT again, then SIGTERM, a
        few milliseconds apart; the robot must still shut down cleanly and exit 0."""
        if self.alive():
            for sig, pause in ((signal.SIGINT, 0.002), (signal.SIGINT, 0.001), (signal.SIGTERM, 0)):
                self.process.send_signal(sig)
                time.sleep(pause)
            try:
                self.process.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # hung: every thread's stack into the log
                self.process.send_signal(signal.SIGABRT)
                try:
                    self.process.wait(5.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        return self.process.returncode


def fixed_rgb(seed: int, h: int = 24, w: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def fixed_image(seed: int, h: int = 24, w: int = 40) -> Image:
    rgb = fixed_rgb(seed, h, w)
    return Image(height=h, width=w, encoding="rgb8", step=3 * w, data=rgb.tobytes())


def fixed_compressed(seed: int, fmt: str = "png") -> CompressedImage:
    """The pixels of fixed_image(seed), as an image_transport `compressed` publisher sends them."""
    import io

    import PIL.Image

    out = io.BytesIO()
    PIL.Image.fromarray(fixed_rgb(seed)).save(out, format=fmt.upper(), quality=90)
    return CompressedImage(format=f"rgb8; {fmt} compressed rgb8", data=out.getvalue())


class Probe:
    """This process's view of the robot: its topics and services."""

    def __init__(self, robot: Robot):
        self.robot = robot
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("probe", namespace=robot.namespace, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        node = self.node
        self.actions = RateProbe(1.0 / RATE_HZ)
        self.action_values: list[tuple[float, bytes]] = []  # (arrival, float64 bytes)
        self.chunks: list[tuple[float, JointTrajectory]] = []
        self.text: list[tuple[float, TextChunk]] = []
        self.plans: list[tuple[float, TextChunk]] = []
        self.diagnostics: DiagnosticArray | None = None
        node.create_subscription(Float64MultiArray, "action", self._on_action, 200)
        node.create_subscription(JointTrajectory, "action_chunk", self._stamp(self.chunks), 50)
        node.create_subscription(TextChunk, "text", self._stamp(self.text), 200)
        node.create_subscription(TextChunk, "plan", self._stamp(self.plans), 200)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        self.pub = {
            "front": node.create_publisher(Image, "camera/front/image_raw", 10),
            "wrist": node.create_publisher(CompressedImage, WRIST_TOPIC, 10),
            "joint_states": node.create_publisher(JointState, "joint_states", 10),
            "instruction": node.create_publisher(String, "instruction", 10),
            "question": node.create_publisher(String, "question", 200),  # bursts
            "memory": node.create_publisher(MemoryUpdate, "memory/update", 10),
            "plan_request": node.create_publisher(String, "plan_request", 10),
        }
        self.srv = {
            "snapshot": node.create_client(Snapshot, "kv_manager/snapshot"),
            "reset": node.create_client(Reset, "kv_manager/reset"),
            "rollback": node.create_client(Rollback, "kv_manager/rollback"),
            "list_capsules": node.create_client(ListCapsules, "kv_manager/list_capsules"),
        }
        self.lifecycle = {
            cls.NAME: (
                node.create_client(ChangeState, f"{cls.NAME}/change_state"),
                node.create_client(GetState, f"{cls.NAME}/get_state"),
            )
            for cls in NODE_CLASSES
        }
        self.execute = ActionClient(node, Execute, "prefill/execute")
        self._thread = threading.Thread(target=self._spin, name="probe", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _on_action(self, msg: Float64MultiArray) -> None:
        self.actions.record()
        self.action_values.append((time.monotonic(), np.array(msg.data).tobytes()))

    @staticmethod
    def _stamp(into: list):
        return lambda msg: into.append((time.monotonic(), msg))

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        if any(s.name.startswith("embodied_kv") for s in msg.status):
            self.diagnostics = msg

    # -- waiting ---------------------------------------------------------------------

    @staticmethod
    def wait_until(predicate, what: str, timeout: float = TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.01)
        return value

    def wait_for_actions(self, n: int = 10, timeout: float = TIMEOUT_S) -> None:
        since = time.monotonic()
        self.wait_until(lambda: self.actions.count(since) >= n, f"{n} actions", timeout)

    # -- publishing ------------------------------------------------------------------

    def publish(self, key: str, msg) -> None:
        pub = self.pub[key]
        self.wait_until(lambda: pub.get_subscription_count() > 0, f"a subscriber of {key}")
        pub.publish(msg)

    def observe(self, seed: int = 0, instruction: str = "pick up the red block") -> None:
        """The same camera frames, joint state and instruction for the same seed; the
        robot holds them (latest wins) before this returns."""
        for _ in range(3):
            self.publish("front", fixed_image(seed))
            self.publish("wrist", fixed_compressed(seed + 1000))
            positions = np.random.default_rng(seed).uniform(-1, 1, len(JOINTS)).tolist()
            self.publish("joint_states", JointState(name=JOINTS, position=positions))
            self.publish("instruction", String(data=instruction))
            time.sleep(0.1)
        time.sleep(0.2)

    def first_chunk_after(self, since: float) -> bytes:
        """Positions (float64 bytes) of the first action_chunk of frame 0 received after
        `since`: the first chunk of the episode a reset just began."""

        def find():
            for t, msg in list(self.chunks):
                if t >= since and msg.header.frame_id == "0":
                    return np.array([p.positions for p in msg.points], dtype=np.float64).tobytes()
            return None

        return self.wait_until(find, "the first chunk of the episode")

    def ask(self, question: str) -> None:
        self.publish("question", String(data=question))

    def ask_for(self, window_s: float) -> tuple[float, float, int]:
        """A question every 0.5 s for `window_s` -> (start, end, questions asked)."""
        start = time.monotonic()
        asked = 0
        while time.monotonic() < start + window_s:
            self.ask(f"what is on the table, look number {asked}?")
            asked += 1
            time.sleep(0.5)
        return start, time.monotonic(), asked

    # -- services --------------------------------------------------------------------

    def call(self, name: str, request, timeout: float = TIMEOUT_S):
        client = self.srv.get(name) or name
        assert client.wait_for_service(timeout_sec=timeout), f"{client.srv_name} not available"
        future = client.call_async(request)
        self.wait_until(future.done, f"a response from {client.srv_name}", timeout)
        return future.result()

    def change_state(self, node: str, transition: int) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition))
        return self.call(self.lifecycle[node][0], request, timeout=60.0).success

    def state(self, node: str) -> int:
        return self.call(self.lifecycle[node][1], GetState.Request()).current_state.id

    def all_active(self) -> bool:
        return all(self.state(c.NAME) == State.PRIMARY_STATE_ACTIVE for c in NODE_CLASSES)

    # -- text ------------------------------------------------------------------------

    def requests(self, task: int, since: float = 0.0) -> dict[str, list[TextChunk]]:
        """request id -> its chunks in arrival order, for chunks received after `since`."""
        source = self.plans if task == TextChunk.TASK_PLAN else self.text
        out: dict[str, list[TextChunk]] = {}
        for t, msg in list(source):
            if t >= since and msg.task == task:
                out.setdefault(msg.request_id, []).append(msg)
        return out

    def wait_text_idle(self, timeout: float = 30.0) -> None:
        """Until every request seen on `text` and `plan` has its done chunk."""

        def idle() -> bool:
            for task in (TextChunk.TASK_ANSWER, TextChunk.TASK_PLAN):
                for chunks in self.requests(task).values():
                    if not any(c.done for c in chunks):
                        return False
            return True

        self.wait_until(idle, "every text request to finish", timeout)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5.0)
        self._thread.join(5.0)
        self.node.destroy_node()
        self.context.try_shutdown()


def write_capsules_of_earlier_processes(disk: Path) -> None:
    """What other processes left in the disk tier: a capsule of the same weights but
    another arena config (max_len), and one of this config with answers in flight."""
    from embodied_kv.engine.engine import Engine, EngineConfig
    from embodied_kv.kv.capsule_store import StoreConfig
    from embodied_kv.model.synthetic import synthetic_observation

    store = StoreConfig(disk_dir=str(disk))
    Engine(EngineConfig(max_len=1024, store=store)).snapshot(FOREIGN, "disk")
    earlier = Engine(EngineConfig(control_hz=RATE_HZ, max_decode_steps=2, store=store))
    earlier.begin_episode()
    earlier.observe(synthetic_observation(earlier.model.cfg, 0))
    for i in range(EARLIER_ANSWERS):
        earlier.ask(f"earlier question {i}?")
    earlier.cycle(0)
    assert len(earlier.manager.live()) == EARLIER_ANSWERS
    earlier.snapshot(EARLIER, "disk", pin=True)


@pytest.fixture(scope="session")
def robot(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("robot")
    write_capsules_of_earlier_processes(workdir / "capsules")
    yield from run_robot(Robot(workdir))


# The `ar` action mode (ActionFlow): FAST tokens over 4 ticks x 8 joints, a ring of K = 12
# slots; language decodes join the pipeline's packed step.
AR_CONFIG = CONFIG.replace(
    "    replan_every: 5\n",
    "    replan_every: 5\n    action_mode: ar\n"
    "    ar: {tokenizer: fast, horizon: 4, max_tokens: 12, fast_vocab: 1024}\n"
    "    arena: {num_slots: 16}\n",
)


@pytest.fixture(scope="module")
def ar_robot(tmp_path_factory):
    """A second robot process in `ar` mode, for one module (the session robot is not
    started by that module, so the two do not share the CPU)."""
    yield from run_robot(Robot(tmp_path_factory.mktemp("ar_robot"), AR_CONFIG, "/robot_ar"))


def run_robot(robot: Robot):
    probe = Probe(robot)
    try:
        probe.wait_until(
            lambda: probe.actions.count() > 0 or not robot.alive(),
            "the robot's first action",
            STARTUP_TIMEOUT_S,
        )
        assert robot.alive(), f"robot exited {robot.process.returncode}:\n{robot.log()[-3000:]}"
        probe.observe()
        yield probe
    finally:
        probe.close()
        status = robot.stop()
    log = robot.log()
    assert status == 0, f"robot exited {status}:\n{log[-3000:]}"
    assert "Traceback" not in log and "InvalidHandle" not in log, log[-3000:]
    for cls in NODE_CLASSES:
        assert f"{cls.NAME}]: cleaned up" in log
    assert "engine freed (last user)" in log
