"""The `action_expert` node.

Turns the prefix KV of the latest frame into an action chunk and publishes
`action` at control_rate_hz (DESIGN §5).

Skeleton: lifecycle transitions and parameters only; the engine is wired in by
later issues.
"""

from __future__ import annotations

from embodied_kv.ros.lifecycle_node import EmbodiedNode


class ActionExpertNode(EmbodiedNode):
    NAME = "action_expert"

    def __init__(self, **kwargs) -> None:
        super().__init__(self.NAME, **kwargs)
