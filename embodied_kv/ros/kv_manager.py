"""The `kv_manager` node.

Hosts the capsule services (snapshot, reset, rollback, list_capsules) and
`/diagnostics` (DESIGN §5; FlashRT capsules).

Skeleton: lifecycle transitions and parameters only; the engine is wired in by
later issues.
"""

from __future__ import annotations

from embodied_kv.ros.lifecycle_node import EmbodiedNode


class KvManagerNode(EmbodiedNode):
    NAME = "kv_manager"

    def __init__(self, **kwargs) -> None:
        super().__init__(self.NAME, **kwargs)
