"""The `memory_planner` node: world memory in, plans out.

Memory updates from `memory/update` (own MemoryUpdate: add / update / remove by
segment_id, an optional group) change the engine's planner memory (kv/memory.py: part
of the session, so a capsule carries it and `reset` empties it). A `plan_request`
(std_msgs/String: the goal) becomes a plan request `plan-<n>@<epoch>` over the whole
memory (`\nFacts: ...\nQuery: <goal>\nAnswer: `); with `memory.mode: keep` (the
default) the memory comes as cached KV with KEEP's selective recomputation, with
`full` it is prefilled as text. The backbone decodes it from a later frame's prefix
and the text streams as TextChunk on `plan`. A plan whose prompt
cannot fit a KV slot whole is refused (one done chunk, STATUS_REFUSED, the reason),
never cut. Every string is checked against its limit before it is used; a rejected
one is logged as a short excerpt and counted.
"""

from __future__ import annotations

import time

from std_msgs.msg import String

from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.kv.manager import TaskKind
from embodied_kv.msg import MemoryUpdate, TextChunk
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import excerpt, text_msg

QUEUE_DEPTH = 100  # bursts of updates and plan requests reach the engine's checks


class MemoryPlannerNode(EmbodiedNode):
    NAME = "memory_planner"

    def __init__(self, **kwargs) -> None:
        self._pub = None
        self._subs: list = []
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("max_segments", 32)
        self.declare_parameter("max_segment_chars", 200)
        self.declare_parameter("max_segment_id_chars", 64)
        self.declare_parameter("max_goal_chars", 200)

    def setup(self) -> None:
        self._pub = self.create_lifecycle_publisher(TextChunk, "plan", 50)
        self._subs = [
            self.create_subscription(MemoryUpdate, "memory/update", self._on_update, QUEUE_DEPTH),
            self.create_subscription(String, "plan_request", self._on_plan_request, QUEUE_DEPTH),
        ]
        self.host.listen(self.NAME, self._publish)

    def teardown(self) -> None:
        self.host.unlisten(self.NAME)
        for sub in self._subs:
            self.destroy_subscription(sub)
        if self._pub is not None:
            self.destroy_lifecycle_publisher(self._pub)
        self._subs, self._pub = [], None

    # -- callbacks -------------------------------------------------------------------

    def _on_update(self, msg: MemoryUpdate) -> None:
        if not self.active:
            self.reject("memory/update", "memory_planner is inactive; update ignored")
            return
        keep = "; memory unchanged"
        for what, text, param in (("segment_id", msg.segment_id, "max_segment_id_chars"),
                                  ("segment text", msg.text, "max_segment_chars"),
                                  ("group", msg.group, "max_segment_id_chars")):  # fmt: skip
            if self.too_long("memory/update", what, text, param, keep):
                return
        key, text, group = msg.segment_id.strip(), msg.text.strip(), msg.group.strip()
        try:
            self.engine.update_memory(
                msg.operation, key, text, self.param("max_segments"), group
            )
        except ValueError as e:
            self.reject("memory/update", f"{e}; memory unchanged")

    def _on_plan_request(self, msg: String) -> None:
        if not self.active:
            self.reject("plan_request", "memory_planner is inactive; plan request ignored")
            return
        if self.too_long("plan_request", "goal", msg.data, "max_goal_chars"):
            return
        goal = msg.data.strip()
        if not goal:
            self.reject("plan_request", "empty goal; no plan requested")
            return
        n = len(self.engine.memory)
        request_id, refusal = self.engine.plan(goal)
        if refusal is not None:
            self._pub.publish(text_msg(refusal, time.time_ns()))
            self.reject(
                "plan_request",
                f"{request_id} ({n} memory segments) refused: {refusal.reason}",
                refusal.reason,
            )
            return
        self.get_logger().info(
            f"plan request {request_id}: goal {excerpt(goal)} over {n} memory segments"
        )

    def _publish(self, result: CycleResult, tick: int) -> None:
        if not self.active:
            return
        stamp = time.time_ns()
        for event in result.events:
            if event.kind is TaskKind.PLAN:
                self._pub.publish(text_msg(event, stamp))
