"""The robot process: the five lifecycle nodes (docs/ros.md) in one process.

One process holds one engine (one GPU context), shared by the nodes through an
EngineHost; a SingleThreadedExecutor spins every node on a background thread while
the main thread drives the lifecycle and waits. The engine's cycle and the action
output run on threads of their own (cycle_thread.py, action_output.py), never in
an executor callback. `ros2 run embodied_kv robot`, `ros2 launch embodied_kv
robot.launch.py` and `make demo` (which starts this as its robot) all run `main()`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from embodied_kv.config_file import RobotParams, default_config_path, load_params
from embodied_kv.ros.action_expert import ActionExpertNode
from embodied_kv.ros.engine_host import EngineHost
from embodied_kv.ros.kv_manager import KvManagerNode
from embodied_kv.ros.language_expert import LanguageExpertNode
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.memory_planner import MemoryPlannerNode
from embodied_kv.ros.prefill import PrefillNode

# Creation order = configure order; the kv_manager comes first once it owns the arena.
NODE_CLASSES: tuple[type[EmbodiedNode], ...] = (
    KvManagerNode,
    PrefillNode,
    ActionExpertNode,
    LanguageExpertNode,
    MemoryPlannerNode,
)
CONTAINER_KEYS = ("autostart",)  # read by the container, not declared by nodes
EXECUTOR_JOIN_TIMEOUT_S = 5.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="robot", description="Run the embodied_kv lifecycle nodes in one process."
    )
    parser.add_argument("--config", help="ROS 2 parameter file (default: config/robot.yaml)")
    parser.add_argument("--preset", default="", help="model preset; overrides the config file")
    parser.add_argument("--weights", default="", help="weights; override the config file")
    parser.add_argument(
        "--autostart",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="configure + activate every node at start (default: the config's autostart)",
    )
    parser.add_argument(
        "--demo-seconds",
        type=float,
        default=None,
        help="exit after this many seconds (default: run until Ctrl-C)",
    )
    return parser.parse_args(list(argv))


def make_nodes(params: RobotParams, host: EngineHost) -> list[EmbodiedNode]:
    nodes = []
    for cls in NODE_CLASSES:
        values = params.for_node(cls.NAME)
        overrides = [Parameter(k, value=v) for k, v in values.items() if k not in CONTAINER_KEYS]
        nodes.append(cls(host=host, parameter_overrides=overrides))
    return nodes


def unknown_parameters(params: RobotParams, nodes: Sequence[EmbodiedNode]) -> list[str]:
    """Config keys that no node declares (typos would otherwise be silently ignored).
    The `serve` section is `embodied-kv serve`'s (serve/config.py checks it)."""
    sections = [v for name, v in params.per_node.items() if name != "serve"]
    keys = set(params.common) | {k for section in sections for k in section}
    return sorted(
        k for k in keys - set(CONTAINER_KEYS) if not any(n.has_parameter(k) for n in nodes)
    )


def _progress(line: str) -> None:
    print(f"embodied_kv: {line}", flush=True)


class StopSignal:
    """SIGINT / SIGTERM in any number and order (`ros2 launch` escalates SIGINT to
    SIGTERM within milliseconds) only ask for a stop: the main thread sees the flag,
    brings every node down once and exits 0. Nothing is raised inside a shutdown."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.count = 0

    def __call__(self, signum, frame) -> None:
        self.count += 1
        self.event.set()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)


def bring_up(nodes: Sequence[EmbodiedNode]) -> str | None:
    """Configure, then activate, every node; None on success, else what failed."""
    for step in ("configure", "activate"):
        for node in nodes:
            result = getattr(node, f"trigger_{step}")()
            if result != TransitionCallbackReturn.SUCCESS:
                return f"{step} of node {node.get_name()} returned {result.name}"
    return None


def bring_down(nodes: Sequence[EmbodiedNode]) -> None:
    """Deactivate and clean up, in reverse order, whatever is still up."""
    for node in reversed(nodes):
        if node.active:
            node.trigger_deactivate()
        if node.configured:
            node.trigger_cleanup()


def _spin(executor: SingleThreadedExecutor) -> None:
    try:
        executor.spin()
    except ExternalShutdownException:
        pass


def _wait(context: rclpy.context.Context, seconds: float | None, stop: threading.Event) -> None:
    deadline = None if seconds is None else time.monotonic() + seconds
    while context.ok() and not stop.is_set():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        stop.wait(0.05 if left is None else min(0.05, left))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(remove_ros_args(["robot", *argv])[1:])
    try:
        params = load_params(args.config or default_config_path())
    except ValueError as e:
        print(f"robot: {e}", file=sys.stderr)
        return 2
    params = params.with_overrides(preset=args.preset or None, weights=args.weights or None)
    autostart = params.common.get("autostart", True) if args.autostart is None else args.autostart

    # Our own signal handling instead of rclpy's, which shuts the context down at once:
    # the nodes then get a clean deactivate + cleanup (later: freeing GPU memory)
    # before the context goes. Installed even where the parent ignores SIGINT (a
    # shell's background job).
    stop = StopSignal()
    with rclpy.init(args=["robot", *argv], signal_handler_options=SignalHandlerOptions.NO) as init:
        stop.install()
        try:
            nodes = make_nodes(params, EngineHost(progress=_progress))
        except Exception as e:  # e.g. a parameter of the wrong type in the config file
            print(f"robot: {params.path}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        for key in unknown_parameters(params, nodes):
            print(f"robot: warning: no node declares parameter {key!r} ({params.path})",
                  file=sys.stderr)  # fmt: skip
        # Single-threaded on purpose: rclpy's MultiThreadedExecutor busy-spins while a
        # ready callback waits for its callback group (measured: 88% of a core beside
        # a camera callback), which starved the engine and the output thread.
        executor = SingleThreadedExecutor(context=init.context)
        for node in nodes:
            executor.add_node(node)
        # daemon: if spin() misses the shutdown (a race inside rclpy's wait), the process
        # still exits after the bounded join below instead of hanging in interpreter exit
        spinner = threading.Thread(
            target=_spin, args=(executor,), name="ros-executor", daemon=True
        )
        spinner.start()
        status = 0
        try:
            if autostart and not stop.event.is_set():
                _progress(f"configuring {len(nodes)} nodes ({params.path}) ...")
                failure = bring_up(nodes)
                if failure is not None:
                    print(f"robot: {failure}", file=sys.stderr)
                    status = 1
                else:
                    names = ", ".join(node.get_name() for node in nodes)
                    presets = sorted({str(node.preset) for node in nodes})
                    print(
                        f"embodied_kv: {len(nodes)} nodes configured and active "
                        f"(preset={','.join(presets)}): {names}",
                        flush=True,
                    )
            if status == 0:
                _wait(init.context, args.demo_seconds, stop.event)
        except (KeyboardInterrupt, ExternalShutdownException):  # a caller's own handler
            pass
        finally:
            if init.context.ok():
                bring_down(nodes)
            else:  # the context went first: still stop every thread before the handles go
                for node in reversed(nodes):
                    node.on_shutdown(None)
            executor.shutdown(timeout_sec=EXECUTOR_JOIN_TIMEOUT_S)
            spinner.join(EXECUTOR_JOIN_TIMEOUT_S)
            if spinner.is_alive():
                print("embodied_kv: the ROS executor did not stop; exiting without it",
                      file=sys.stderr, flush=True)  # fmt: skip
            for node in nodes:
                node.destroy_node()
    if status == 0 and args.demo_seconds is not None:
        print(f"embodied_kv: demo finished after {args.demo_seconds:g} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
