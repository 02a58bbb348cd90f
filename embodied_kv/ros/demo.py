"""`make demo`: the robot process (container.py with config/robot.yaml) beside a
simulated robot, for a bounded time, then a report a person can read.

This process is the robot's world: it publishes camera frames, joint states, an
instruction, questions, memory updates and plan requests (sim_robot.py), calls the
capsule services, and measures the action stream as a subscriber in another
process than the one that publishes it (docs/ros.md). Everything runs in its own
namespace and discovers only on this host, so a real robot on the network never
sees the demo's actions.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import rclpy

from embodied_kv.config_file import default_config_path, load_params

NAMESPACE = "/embodied_kv_demo"
READY_TIMEOUT_S = 300.0  # first run on a cold machine: imports + engine build
EXIT_TIMEOUT_S = 30.0
DEFAULT_SECONDS = 20.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="embodied-kv demo", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="run time once active")
    p.add_argument("--config", help="ROS 2 parameter file (default: config/robot.yaml)")
    p.add_argument("--preset", default="", help="model preset; overrides the config file")
    p.add_argument("--weights", default="", help="weights file; overrides the config file "
                   "(default there: the preset's shipped weights)")  # fmt: skip
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Read when rclpy initialises (not at import); the robot process inherits it.
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    from embodied_kv.ros.demo_world import DemoWorld  # message types: after the env is set

    config = Path(args.config) if args.config else default_config_path()
    try:
        params = load_params(config).with_overrides(preset=args.preset or None)
    except ValueError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    log_path = Path(tempfile.gettempdir()) / "embodied_kv_demo" / "robot.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"demo: starting the robot process (config {config}; its ROS log: {log_path})",
          flush=True)  # fmt: skip
    command = [sys.executable, "-m", "embodied_kv.ros.container", "--config", str(config)]
    if args.preset:
        command += ["--preset", args.preset]
    if args.weights:
        command += ["--weights", str(Path(args.weights).resolve())]
    command += ["--ros-args", "-r", f"__ns:={NAMESPACE}"]
    with open(log_path, "w") as log:
        robot = subprocess.Popen(command, stderr=log)
    try:
        with rclpy.init(args=[]) as init:
            world = DemoWorld(init.context, NAMESPACE, params)
            try:
                report = run(world, robot, args.seconds)
            finally:
                world.close()
    finally:
        status = stop(robot)
    if report is None:
        print(f"demo: the robot never became active; its log ({log_path}):", file=sys.stderr)
        print(tail(log_path), file=sys.stderr)
        return 1
    print(report.render(status), flush=True)
    return 0 if status == 0 and report.ok else 1


def run(world, robot: subprocess.Popen, seconds: float):
    start = time.monotonic()
    next_note = start + 5.0
    while world.listener.actions.last() is None:
        if robot.poll() is not None or time.monotonic() - start > READY_TIMEOUT_S:
            return None
        if time.monotonic() > next_note:
            print(f"demo: configuring ... {time.monotonic() - start:.0f} s", flush=True)
            next_note += 5.0
        time.sleep(0.05)
    print(
        f"demo: robot active after {time.monotonic() - start:.1f} s; "
        f"running the scripted episode for {seconds:g} s ...",
        flush=True,
    )
    return world.play(seconds)


def stop(robot: subprocess.Popen) -> int:
    if robot.poll() is None:
        robot.send_signal(signal.SIGINT)
        try:
            robot.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            robot.kill()
            robot.wait()
    return robot.returncode


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return str(e)


if __name__ == "__main__":
    sys.exit(main())
