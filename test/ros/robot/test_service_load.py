"""The action output never waits for a service (issue 35, 3): while several clients, each
its own DDS participant, call `reset`, `rollback` and `snapshot` in a loop and answers
stream, a subscriber in another process (action_recorder.py) measures the action stream:
its rate stays within 1 % of the target and no gap between two actions exceeds 3 periods.
The robot's own /diagnostics say no tick left late and no full garbage collection paused
it for a period, over the ~20 s that include the clients' start.

The window opens once the clients' participants are discovered (every service found, then
SETTLE_S): while 4 participants join, a subscriber's own DDS participant can hold the
samples it receives for ~0.3 s (measured, docs/ros.md "Services under load": the robot
published every tick on time). That phase is measured and printed; the robot's side of
it is asserted by the lateness above.
(A response that DDS loses under this load is counted and reported; every client must
still get answered calls, none refused.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor

from embodied_kv.srv import Reset, Rollback, Snapshot

RATE_HZ, PERIOD_S = 50.0, 0.02
WINDOW_S = 10.0  # the clients call for this long (a 1 % rate needs a few hundred actions)
MAX_CALLS = 1000  # per client, at most (measured: up to 320 calls a second in all)
CALL_TIMEOUT_S = 3.0  # a response DDS lost under this load is counted, the loop goes on
DISCOVERY_TIMEOUT_S = 20.0  # a new participant finds the services (a loaded machine)
# After the last client found its service: measured, the subscriber-side holds of discovery
# ended by 0.41 s after it (5 holds of 0.32-0.33 s in 44 loaded runs, all within 3.4 s of
# the clients' creation); the hammering window opens after this.
SETTLE_S = 1.0
RECORDER = Path(__file__).with_name("action_recorder.py")
TARGET = "hammer_mark"


class Hammer(threading.Thread):
    """One client in a participant of its own, calling one service in a loop."""

    def __init__(self, namespace: str, i: int, kind: str, until: float):
        super().__init__(name=f"hammer-{i}", daemon=True)
        self.kind, self.until = kind, until
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(f"hammer_{i}", namespace=namespace, context=self.context)
        srv, name, self.request = {
            "reset": (Reset, "kv_manager/reset", Reset.Request()),
            "rollback": (Rollback, "kv_manager/rollback", Rollback.Request(name=TARGET)),
            "snapshot": (Snapshot, "kv_manager/snapshot", Snapshot.Request(name=f"hammer_{i}")),
        }[kind]
        self.client = self.node.create_client(srv, name)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.calls, self.failures, self.lost = 0, [], 0

    def run(self) -> None:
        while self.calls < MAX_CALLS and time.monotonic() < self.until:
            future = self.client.call_async(self.request)
            self.executor.spin_until_future_complete(future, timeout_sec=CALL_TIMEOUT_S)
            self.calls += 1
            response = future.result()
            if response is None:
                self.client.remove_pending_request(future)
                self.lost += 1
            elif not response.success:
                self.failures.append(response.message)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5.0)
        self.node.destroy_node()
        self.context.try_shutdown()


def test_service_hammering_never_stalls_the_action_stream(robot, tmp_path):
    robot.observe(seed=5)
    assert robot.call("snapshot", Snapshot.Request(name=TARGET, tier=1)).success
    out, stop = tmp_path / "actions.json", tmp_path / "stop"
    recorder = subprocess.Popen(
        [sys.executable, str(RECORDER), robot.robot.namespace, str(out), str(stop),
         str(WINDOW_S + 60.0)],
    )  # fmt: skip
    try:
        robot.wait_until((tmp_path / "ready").exists, "the recorder's first action", 60.0)
        for i in range(4):
            robot.ask(f"while the services are hammered, describe the scene, part {i}?")
        kinds = ("reset", "reset", "rollback", "snapshot")
        created = time.monotonic()
        hammers = [Hammer(robot.robot.namespace, i, k, 0.0) for i, k in enumerate(kinds)]
        for h in hammers:
            assert h.client.wait_for_service(timeout_sec=DISCOVERY_TIMEOUT_S)
        found = time.monotonic()
        time.sleep(SETTLE_S)
        t0 = time.monotonic()
        for h in hammers:
            h.until = t0 + WINDOW_S
            h.start()
        for h in hammers:
            h.join(WINDOW_S + 2 * CALL_TIMEOUT_S)
        t1 = time.monotonic()
    finally:
        stop.write_text("1")
        recorder.wait(60.0)
    for h in hammers:
        h.close()
    arrivals = np.array(json.loads(out.read_text()))
    joining = np.diff(arrivals[(arrivals >= created) & (arrivals <= t0)])
    window = arrivals[(arrivals >= t0) & (arrivals <= t1)]
    gaps = np.diff(window)
    rate = (len(window) - 1) / (window[-1] - window[0])
    calls = {f"{h.kind}-{i}": h.calls - h.lost for i, h in enumerate(hammers)}
    lost = sum(h.lost for h in hammers)
    line = (f"{sum(calls.values())} calls {calls} in {t1 - t0:.1f} s; {len(window)} actions: "
            f"{rate:.2f} Hz, gap p99 {np.percentile(gaps, 99) * 1e3:.1f} ms, "
            f"max {gaps.max() * 1e3:.1f} ms; {lost} responses lost")  # fmt: skip
    time.sleep(0.6)  # the next /diagnostics: the robot's own view of the same seconds
    robot.wait_until(lambda: robot.diagnostics is not None, "/diagnostics")
    output = {kv.key: kv.value for s in robot.diagnostics.status for kv in s.values
              if s.name == "embodied_kv: action output"}  # fmt: skip
    late_ms = float(output["lateness_max_ms"])  # the output thread's last 1,024 ticks
    line += (f"; robot side: lateness max {late_ms:.1f} ms over its last 1,024 ticks, "
             f"full GC pause max {output['gc_full_pause_max_ms']} ms")  # fmt: skip
    line += (f"; while the clients joined ({found - created:.1f} s to find the services, "
             f"then {SETTLE_S:.0f} s): gap max {joining.max() * 1e3:.0f} ms")  # fmt: skip
    failures = [(h.kind, h.failures[:3]) for h in hammers if h.failures]
    line += f"; refused: {failures}" if failures else ""
    print(f"\n{line}")
    assert all(not h.is_alive() for h in hammers), line
    assert all(h.calls - h.lost >= 5 and not h.failures for h in hammers), (line, failures)
    assert abs(rate - RATE_HZ) <= 0.01 * RATE_HZ, line
    # The output never stalls: every tick of the last ~20 s (the window, and the seconds
    # before it) left within 3 periods of its time.
    assert late_ms <= 3 * PERIOD_S * 1e3, line
    # From another process: no gap over 3 periods while the services are hammered.
    assert gaps.max() <= 3 * PERIOD_S, line
    assert float(output["gc_full_pause_max_ms"]) < PERIOD_S * 1e3, output
    if os.geteuid() == 0:  # the output thread got its priority (ros/thread_priority.py)
        assert int(output["output_nice"]) == -10, output
    assert int(output["gc_frozen_objects"]) > 100_000, output
