"""The `language_expert` node: questions in, streamed text out.

Each `question` (std_msgs/String) becomes an answer request `answer-<n>@<epoch>`
of a later frame (engine/policy.py: waiting in a bounded queue until a slot is
free); the engine decodes it together with every other live request across frames
(OxyGen continuous batching) and each cycle's new tokens are published as a
TextChunk on `text` (narrations too), the last chunk of a request with done=true
and its status. A question the engine refuses (queue full, too long for a slot)
gets its one done chunk with STATUS_REFUSED and the reason at once.
"""

from __future__ import annotations

import time

from std_msgs.msg import String

from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.kv.manager import TaskKind
from embodied_kv.msg import TextChunk
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import excerpt, text_msg

KINDS = (TaskKind.ANSWER, TaskKind.NARRATION)
QUEUE_DEPTH = 100  # a burst of questions reaches the engine's queue, which refuses with a reason


class LanguageExpertNode(EmbodiedNode):
    NAME = "language_expert"

    def __init__(self, **kwargs) -> None:
        self._pub = None
        self._sub = None
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("max_question_chars", 120)

    def setup(self) -> None:
        self._pub = self.create_lifecycle_publisher(TextChunk, "text", 50)
        self._sub = self.create_subscription(String, "question", self._on_question, QUEUE_DEPTH)
        self.host.listen(self.NAME, self._publish)

    def teardown(self) -> None:
        self.host.unlisten(self.NAME)
        if self._sub is not None:
            self.destroy_subscription(self._sub)
        if self._pub is not None:
            self.destroy_lifecycle_publisher(self._pub)
        self._pub = self._sub = None

    def _on_question(self, msg: String) -> None:
        if not self.active:
            self.reject("question", "language_expert is inactive; question ignored")
            return
        if self.too_long("question", "question", msg.data, "max_question_chars"):
            return
        text = msg.data.strip()
        if not text:
            self.reject("question", "empty question ignored")
            return
        request_id, refusal = self.engine.ask(text, TaskKind.ANSWER)
        if refusal is not None:
            self._pub.publish(text_msg(refusal, time.time_ns()))
            self.reject("question", f"{request_id} refused: {refusal.reason}", refusal.reason)
            return
        self.get_logger().info(f"question {excerpt(text)} -> request {request_id}")

    def _publish(self, result: CycleResult, tick: int) -> None:
        if not self.active:
            return  # deactivated: text output stops (requests keep their state)
        stamp = time.time_ns()
        for event in result.events:
            if event.kind in KINDS:
                self._pub.publish(text_msg(event, stamp))
