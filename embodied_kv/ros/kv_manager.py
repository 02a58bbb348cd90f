"""The `kv_manager` node: capsule services and /diagnostics (FlashRT capsules).

Services `snapshot`, `reset`, `rollback`, `list_capsules` (own srv types) exist for
the node's whole life so that a client never waits on a missing server: while the
node is not active they answer success=False with the reason. Every engine error
(unknown capsule, one from other weights or config, a corrupted disk capsule, ...)
becomes success=False with the engine's message. `/diagnostics` (DiagnosticArray)
is published every diagnostics_period_s while active.
"""

from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray

from embodied_kv.engine.engine import EPISODE_START
from embodied_kv.kv.capsule_store import TIERS
from embodied_kv.ros.diagnostics import diagnostics_sections
from embodied_kv.ros.lifecycle_node import EmbodiedNode
from embodied_kv.ros.messages import diagnostics_msg
from embodied_kv.srv import ListCapsules, Reset, Rollback, Snapshot


class KvManagerNode(EmbodiedNode):
    NAME = "kv_manager"

    def __init__(self, **kwargs) -> None:
        self._diag_pub = None
        self._diag_timer = None
        super().__init__(self.NAME, **kwargs)
        # The services live as long as the node (see the module docstring).
        for srv_type, name, handler in (
            (Snapshot, "~/snapshot", self._snapshot),
            (Reset, "~/reset", self._reset),
            (Rollback, "~/rollback", self._rollback),
            (ListCapsules, "~/list_capsules", self._list),
        ):
            self.create_service(srv_type, name, self._guard(handler))

    def declare_node_parameters(self) -> None:
        self.declare_parameter("diagnostics_period_s", 1.0)

    def setup(self) -> None:
        self._diag_pub = self.create_lifecycle_publisher(DiagnosticArray, "/diagnostics", 10)
        for line in self.engine.store.warnings:  # a degraded capsule folder: configured anyway
            self.get_logger().warning(f"capsules: {line}")

    def teardown(self) -> None:
        if self._diag_pub is not None:
            self.destroy_lifecycle_publisher(self._diag_pub)
        self._diag_pub = None

    def start(self) -> None:
        period = float(self.param("diagnostics_period_s"))
        self._diag_timer = self.create_timer(period, self._publish_diagnostics)

    def stop(self) -> None:
        if self._diag_timer is not None:
            self.destroy_timer(self._diag_timer)
        self._diag_timer = None

    # -- services ----------------------------------------------------------------------

    def _guard(self, handler):
        """success=False with a reason while not active or when the handler raises."""

        def serve(request, response):
            if not self.active:
                state = "inactive" if self.configured else "unconfigured"
                response.success = False
                response.message = f"kv_manager is {state}: activate it first"
                return response
            try:
                handler(request, response)
                response.success = True
                return response
            except ValueError as e:  # the caller's mistake, in the engine's words
                response.message = str(e)
            except Exception as e:
                response.message = f"{type(e).__name__}: {e}"
            response.success = False
            self.get_logger().warning(f"{handler.__name__[1:]} refused: {response.message}")
            return response

        return serve

    def _snapshot(self, request: Snapshot.Request, response: Snapshot.Response) -> None:
        if request.tier >= len(TIERS):
            raise ValueError(f"tier {request.tier} unknown (TIER_GPU=0, HOST=1, DISK=2)")
        info, ms = self.engine.snapshot(request.name, TIERS[request.tier], request.pin)
        response.bytes, response.digest, response.elapsed_ms = info.nbytes, info.digest, ms
        response.message = f"{info.name}: {info.nbytes} B in the {info.tier} tier, {ms:.2f} ms"

    def _reset(self, request: Reset.Request, response: Reset.Response) -> None:
        name = request.name or EPISODE_START
        response.restore_ms = self.engine.reset(name)
        response.message = f"restored {name} in {response.restore_ms:.2f} ms"
        self.get_logger().info(f"reset: {response.message}")

    def _rollback(self, request: Rollback.Request, response: Rollback.Response) -> None:
        if bool(request.name) == bool(request.steps_back):
            raise ValueError(
                f"set exactly one of name ({request.name!r}) and steps_back ({request.steps_back})"
            )
        response.restore_ms = self.engine.rollback(request.name, request.steps_back)
        target = request.name or f"{request.steps_back} engine cycle(s) back"
        response.message = f"rolled back to {target} in {response.restore_ms:.2f} ms"
        self.get_logger().info(response.message)

    def _list(self, request: ListCapsules.Request, response: ListCapsules.Response) -> None:
        infos = self.engine.store.list()
        response.names = [i.name for i in infos]
        response.tiers = [TIERS.index(i.tier) for i in infos]
        response.bytes = [i.nbytes for i in infos]
        response.pinned = [i.pinned for i in infos]
        response.digests = [i.digest for i in infos]

    # -- diagnostics -------------------------------------------------------------------

    def _publish_diagnostics(self) -> None:
        try:
            sections = diagnostics_sections(self.host)
            self._diag_pub.publish(diagnostics_msg(time.time_ns(), "embodied_kv", sections))
        except Exception as e:
            self.get_logger().error(f"diagnostics: {type(e).__name__}: {e}")
