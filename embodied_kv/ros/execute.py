"""`~/execute` (own Execute.action): a task as a ROS 2 action, as ROS users expect for
long-running goals.

goal = instruction (+ optional time limit); while it runs, every engine cycle's
feedback carries the frame, the actions published since the goal began and the
latest narration; the result says how it ended. Accepting a goal sets the
instruction of the following frames and resumes a held engine; a newer goal ends
the running one ABORTED; cancel holds the last action (Engine.hold) until the next
goal or a reset; deactivation or the engine's safe state abort it. Everything runs
on the executor thread: a timer at the engine's cycle period drives the goal, and
the execute callback only awaits the future that timer completes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.action.server import ServerGoalHandle
from rclpy.task import Future

from embodied_kv.action import Execute
from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.kv.manager import TaskKind
from embodied_kv.ros.messages import excerpt


@dataclass
class Running:
    handle: ServerGoalHandle
    deadline: float | None  # time.monotonic(); None = until cancelled
    actions0: int  # actions published when it began
    done: Future  # -> Execute.Result
    frames: int = 0


class ExecuteServer:
    def __init__(self, node, set_instruction: Callable[[str], None], max_chars: int):
        self.node, self.host = node, node.host
        self._set_instruction, self._max_chars = set_instruction, max_chars
        self._running: Running | None = None
        self._narration = ""
        self._frame = 0
        self._timer = None
        self._server = ActionServer(
            node,
            Execute,
            "~/execute",
            execute_callback=self._execute,
            goal_callback=self._on_goal,
            cancel_callback=lambda handle: CancelResponse.ACCEPT,
        )
        self.host.listen(f"{node.NAME}/execute", self._on_cycle)

    def start(self) -> None:
        self._timer = self.node.create_timer(self.host.cfg.period_s, self._tick)

    def stop(self) -> None:
        self._finish(Execute.Result.STATUS_ABORTED, "aborted: prefill was deactivated")
        if self._timer is not None:
            self.node.destroy_timer(self._timer)
        self._timer = None

    def destroy(self) -> None:
        self.stop()
        self.host.unlisten(f"{self.node.NAME}/execute")
        self._server.destroy()

    # -- goal lifecycle (executor thread) ------------------------------------------------

    def _on_goal(self, goal: Execute.Goal) -> GoalResponse:
        text = goal.instruction
        reason = ""
        if not self.node.active:
            reason = "prefill is inactive"
        elif len(text) > self._max_chars or not text.strip():
            reason = f"instruction of {len(text)} chars (1..{self._max_chars}): {excerpt(text)}"
        elif not goal.time_limit_s >= 0:
            reason = f"time_limit_s={goal.time_limit_s} must be >= 0"
        if reason:
            self.node.reject("execute", f"goal refused: {reason}", "execute goal refused")
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    async def _execute(self, handle: ServerGoalHandle) -> Execute.Result:
        self._finish(Execute.Result.STATUS_ABORTED, "aborted: a newer goal replaced it")
        goal = handle.request
        limit = goal.time_limit_s
        output = self.host.output
        self._running = Running(
            handle,
            time.monotonic() + limit if limit > 0 else None,
            output.counters.published if output is not None else 0,
            Future(),
        )
        self._set_instruction(goal.instruction.strip())
        self.node.engine.resume()
        self.node.get_logger().info(
            f"execute: {excerpt(goal.instruction)} for "
            f"{f'{limit:g} s' if limit > 0 else 'until cancelled'}"
        )
        return await self._running.done

    def _tick(self) -> None:
        run = self._running
        if run is None:
            return
        engine = self.node.engine
        if run.handle.is_cancel_requested:
            engine.hold()
            self._finish(Execute.Result.STATUS_CANCELED, "cancelled: holding the last action")
        elif engine.faults.safe:
            self._finish(Execute.Result.STATUS_ABORTED, f"aborted: {engine.faults.safe_reason}")
        elif run.deadline is not None and time.monotonic() >= run.deadline:
            self._finish(Execute.Result.STATUS_SUCCEEDED, "ran until its time limit")
        else:
            output = self.host.output
            published = output.counters.published if output is not None else run.actions0
            run.handle.publish_feedback(
                Execute.Feedback(
                    frame=self._frame,
                    actions=max(0, published - run.actions0),
                    narration=self._narration,
                )
            )

    def _finish(self, status: int, message: str) -> None:
        run, self._running = self._running, None
        if run is None or run.done.done():
            return
        handle = run.handle
        if handle.is_active:
            if status == Execute.Result.STATUS_SUCCEEDED:
                handle.succeed()
            elif status == Execute.Result.STATUS_CANCELED and handle.is_cancel_requested:
                handle.canceled()
            else:
                handle.abort()
        run.done.set_result(Execute.Result(status=status, message=message, frames=run.frames))
        self.node.get_logger().info(f"execute: {message} after {run.frames} frames")

    # -- engine cycles (cycle thread): frame and latest narration --------------------------

    def _on_cycle(self, result: CycleResult, tick: int) -> None:
        if result.chunk is not None:
            self._frame = result.frame
            run = self._running
            if run is not None:
                run.frames += 1
        for event in result.events:
            if event.kind is TaskKind.NARRATION and event.text:
                self._narration = event.text
