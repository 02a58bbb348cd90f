"""`prefill/execute`: a task as a ROS 2 action that runs, reports feedback and cancels."""

from __future__ import annotations

import time

from embodied_kv.action import Execute


def send(robot, instruction: str, time_limit_s: float = 0.0):
    """-> (goal handle, feedback list) once the goal is accepted."""
    client = robot.execute
    assert client.wait_for_server(timeout_sec=15.0), "prefill/execute not available"
    feedback = []
    future = client.send_goal_async(
        Execute.Goal(instruction=instruction, time_limit_s=time_limit_s),
        feedback_callback=lambda msg: feedback.append(msg.feedback),
    )
    robot.wait_until(future.done, "the goal response")
    handle = future.result()
    return handle, feedback


def result_of(robot, handle, timeout: float = 15.0):
    future = handle.get_result_async()
    robot.wait_until(future.done, "the goal's result", timeout)
    return future.result().result


def test_execute_runs_reports_feedback_and_cancel_holds_the_last_action(robot):
    robot.observe(seed=4)
    handle, feedback = send(robot, "push the red block to the left", time_limit_s=1.5)
    assert handle.accepted
    result = result_of(robot, handle)
    assert result.status == Execute.Result.STATUS_SUCCEEDED and result.frames >= 5
    assert len(feedback) >= 5
    frames = [f.frame for f in feedback]
    assert frames == sorted(frames) and frames[-1] > frames[0]
    assert feedback[-1].actions >= 40  # 50 Hz for most of 1.5 s

    handle, feedback = send(robot, "keep stacking", time_limit_s=0.0)  # until cancelled
    robot.wait_until(lambda: len(feedback) >= 2, "feedback of the second goal")
    cancel = handle.cancel_goal_async()
    robot.wait_until(cancel.done, "the cancel response")
    result = result_of(robot, handle)
    assert result.status == Execute.Result.STATUS_CANCELED
    time.sleep(0.3)  # the chunk in flight ends; from then on the last action repeats
    since = time.monotonic()
    time.sleep(0.5)
    held = {v for t, v in list(robot.action_values) if t >= since}
    assert len(held) == 1, "after a cancel the robot holds its last action"
    robot.wait_for_actions()  # at the full rate

    refused, _ = send(robot, "x" * 5000)
    assert not refused.accepted
    handle, _ = send(robot, "resume", time_limit_s=0.3)  # a new goal resumes the loop
    assert result_of(robot, handle).status == Execute.Result.STATUS_SUCCEEDED
    since = time.monotonic()
    robot.wait_until(lambda: [m for t, m in robot.chunks if t >= since], "chunks again")
