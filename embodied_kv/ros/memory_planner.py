"""The `memory_planner` node: world memory in, plans out.

Keeps memory segments from `memory/update` (own MemoryUpdate: add / update / remove
by segment_id). A `plan_request` (std_msgs/String: the goal) becomes a plan request
`plan-<n>` whose prompt is the whole memory as text followed by the goal; the
backbone decodes it from the next frame's prefix and the text streams as TextChunk
on `plan`. Every plan re-reads the memory as text (full recomputation): the
baseline that memory kept as KV (KEEP, DESIGN §4) is to be measured against.
"""

from __future__ import annotations

import itertools
import time

from std_msgs.msg import String

from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.kv.manager import TaskKind
from embodied_kv.msg import MemoryUpdate, TextChunk
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import text_msg

OPS = {
    MemoryUpdate.OP_ADD: "add",
    MemoryUpdate.OP_UPDATE: "update",
    MemoryUpdate.OP_REMOVE: "remove",
}


def plan_prompt(segments: dict[str, str], goal: str) -> str:
    lines = [f"- {key}: {text}" for key, text in segments.items()] or ["- (empty)"]
    return "\nMemory:\n" + "\n".join(lines) + f"\nGoal: {goal}\nPlan: "


class MemoryPlannerNode(EmbodiedNode):
    NAME = "memory_planner"

    def __init__(self, **kwargs) -> None:
        self.segments: dict[str, str] = {}  # segment_id -> text, in insertion order
        self._pub = None
        self._subs: list = []
        self._ids = itertools.count(1)
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("max_segments", 32)
        self.declare_parameter("max_segment_chars", 200)

    def setup(self) -> None:
        self._pub = self.create_lifecycle_publisher(TextChunk, "plan", 50)
        self._subs = [
            self.create_subscription(MemoryUpdate, "memory/update", self._on_update, 50),
            self.create_subscription(String, "plan_request", self._on_plan_request, 10),
        ]
        self.host.listen(self.NAME, self._publish)

    def teardown(self) -> None:
        self.host.unlisten(self.NAME)
        for sub in self._subs:
            self.destroy_subscription(sub)
        if self._pub is not None:
            self.destroy_lifecycle_publisher(self._pub)
        self._subs, self._pub = [], None
        self.segments.clear()

    # -- callbacks -------------------------------------------------------------------

    def _on_update(self, msg: MemoryUpdate) -> None:
        if not self.active:
            self.reject("memory/update", "memory_planner is inactive; update ignored")
            return
        try:
            self._apply(msg)
        except ValueError as e:
            self.reject("memory/update", f"{e}; memory unchanged")

    def _apply(self, msg: MemoryUpdate) -> None:
        key, op, text = msg.segment_id.strip(), msg.operation, msg.text.strip()
        if op not in OPS:
            raise ValueError(f"unknown operation {op} (use OP_ADD=0, OP_UPDATE=1, OP_REMOVE=2)")
        if not key:
            raise ValueError(f"{OPS[op]} without a segment_id")
        if op == MemoryUpdate.OP_ADD and key in self.segments:
            raise ValueError(f"add of segment {key!r}, which exists (use OP_UPDATE)")
        if op != MemoryUpdate.OP_ADD and key not in self.segments:
            raise ValueError(f"{OPS[op]} of unknown segment {key!r}")
        if op == MemoryUpdate.OP_REMOVE:
            del self.segments[key]
            return
        limit = self.param("max_segment_chars")
        if not text or len(text) > limit:
            raise ValueError(f"segment {key!r}: text of {len(text)} chars (1..{limit} allowed)")
        if op == MemoryUpdate.OP_ADD and len(self.segments) >= self.param("max_segments"):
            raise ValueError(f"memory is full ({len(self.segments)} segments = max_segments)")
        self.segments[key] = text

    def _on_plan_request(self, msg: String) -> None:
        if not self.active:
            self.reject("plan_request", "memory_planner is inactive; plan request ignored")
            return
        goal = msg.data.strip()
        if not goal:
            self.reject("plan_request", "empty goal; no plan requested")
            return
        request_id = f"plan-{next(self._ids)}"
        self.engine.ask(request_id, plan_prompt(self.segments, goal), TaskKind.PLAN)
        self.get_logger().info(
            f"plan request {request_id}: goal {goal!r} over {len(self.segments)} memory segments"
        )

    def _publish(self, result: CycleResult, tick: int) -> None:
        if not self.active:
            return
        stamp = time.time_ns()
        for event in result.events:
            if event.kind is TaskKind.PLAN:
                self._pub.publish(text_msg(event, stamp))
