"""The `prefill` node.

Prefills each new camera frame once into the shared KV arena, for every task
of that frame (DESIGN §5; OxyGen shared prefill).

Skeleton: lifecycle transitions and parameters only; the engine is wired in by
later issues.
"""

from __future__ import annotations

from embodied_kv.ros.lifecycle_node import EmbodiedNode


class PrefillNode(EmbodiedNode):
    NAME = "prefill"

    def __init__(self, **kwargs) -> None:
        super().__init__(self.NAME, **kwargs)
