"""A subscriber of the robot's `action` in a process of its own (not a test module):
`python action_recorder.py <namespace> <out.json> <stop file> <max seconds>` writes
`ready` beside <out.json> once the first action arrived, records the arrival time
(time.monotonic, one clock for every process of the machine) of each action until the
stop file exists, then writes them as JSON. A measuring process of its own, so that
nothing the test process does (service clients, its own executor) delays an arrival."""

import json
import os
import sys
import time
from pathlib import Path

import rclpy
from rclpy.executors import SingleThreadedExecutor
from std_msgs.msg import Float64MultiArray


def main() -> None:
    namespace, out, stop, seconds = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    seconds = float(seconds)
    try:  # the instrument first: a busy machine must not delay the measurement itself
        os.setpriority(os.PRIO_PROCESS, 0, -5)
    except OSError:
        pass
    rclpy.init()
    node = rclpy.create_node("action_recorder", namespace=namespace)
    arrivals: list[float] = []
    node.create_subscription(Float64MultiArray, "action",
                             lambda msg: arrivals.append(time.monotonic()), 1000)  # fmt: skip
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    end = time.monotonic() + seconds
    while not arrivals and time.monotonic() < end:
        executor.spin_once(timeout_sec=0.1)
    (out.parent / "ready").write_text("1")
    while not stop.exists() and time.monotonic() < end:
        executor.spin_once(timeout_sec=0.02)
    out.write_text(json.dumps(arrivals))
    node.destroy_node()
    rclpy.try_shutdown()


if __name__ == "__main__":
    main()
