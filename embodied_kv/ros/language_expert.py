"""The `language_expert` node.

Keeps decoding narration and answers across frames in one batch and streams
them as TextChunk on `text` (DESIGN §5; OxyGen continuous batching).

Skeleton: lifecycle transitions and parameters only; the engine is wired in by
later issues.
"""

from __future__ import annotations

from embodied_kv.ros.lifecycle_node import EmbodiedNode


class LanguageExpertNode(EmbodiedNode):
    NAME = "language_expert"

    def __init__(self, **kwargs) -> None:
        super().__init__(self.NAME, **kwargs)
