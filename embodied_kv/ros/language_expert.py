"""The `language_expert` node: questions in, streamed text out.

Each `question` (std_msgs/String) becomes an answer request `answer-<n>` of the next
frame; the engine decodes it together with every other live request across frames
(OxyGen continuous batching) and each cycle's new tokens are published as a
TextChunk on `text` (narrations too), the last chunk of a request with done=true.
"""

from __future__ import annotations

import itertools
import time

from std_msgs.msg import String

from embodied_kv.engine.frame_loop import CycleResult
from embodied_kv.kv.manager import TaskKind
from embodied_kv.msg import TextChunk
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import text_msg

KINDS = (TaskKind.ANSWER, TaskKind.NARRATION)


class LanguageExpertNode(EmbodiedNode):
    NAME = "language_expert"

    def __init__(self, **kwargs) -> None:
        self._pub = None
        self._sub = None
        self._ids = itertools.count(1)
        super().__init__(self.NAME, **kwargs)

    def declare_node_parameters(self) -> None:
        self.declare_parameter("max_question_chars", 400)

    def setup(self) -> None:
        self._pub = self.create_lifecycle_publisher(TextChunk, "text", 50)
        self._sub = self.create_subscription(String, "question", self._on_question, 10)
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
        text = msg.data.strip()
        limit = self.param("max_question_chars")
        if not text:
            self.reject("question", "empty question ignored")
            return
        if len(text) > limit:
            self.reject("question", f"question of {len(text)} chars > max_question_chars={limit}")
            return
        request_id = f"answer-{next(self._ids)}"
        self.engine.ask(request_id, text, TaskKind.ANSWER)
        self.get_logger().info(f"question {text!r} -> request {request_id}")

    def _publish(self, result: CycleResult, tick: int) -> None:
        if not self.active:
            return  # deactivated: text output stops (requests keep their state)
        stamp = time.time_ns()
        for event in result.events:
            if event.kind in KINDS:
                self._pub.publish(text_msg(event, stamp))
