"""The `memory_planner` node.

Keeps the world state as reusable KV, fed by `memory/update`, and publishes
`plan` (DESIGN §5; KEEP).

Skeleton: lifecycle transitions and parameters only; the engine is wired in by
later issues.
"""

from __future__ import annotations

from embodied_kv.ros.lifecycle_node import EmbodiedNode


class MemoryPlannerNode(EmbodiedNode):
    NAME = "memory_planner"

    def __init__(self, **kwargs) -> None:
        super().__init__(self.NAME, **kwargs)
