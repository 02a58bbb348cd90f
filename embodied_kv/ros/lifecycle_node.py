"""Lifecycle base of the five nodes (docs/ros.md), in the ros2/demos lifecycle_py style.

`configure` acquires the process's one engine (EngineHost: the first node builds it)
and then calls `setup()` (publishers, subscriptions); `activate` switches lifecycle
publishers on and calls `start()`; `deactivate` calls `stop()` and keeps all state;
`cleanup` calls `teardown()` and releases the engine (the last node frees it). A
transition that fails returns FAILURE with a logged reason and leaves the node alive
in its previous state; a callback that fails logs why (STYLE 7).
"""

from __future__ import annotations

import re
import time

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from embodied_kv.engine.engine import Engine
from embodied_kv.engine.params import ENGINE_PARAMS, engine_config
from embodied_kv.ros import heap
from embodied_kv.ros.engine_host import EngineHost
from embodied_kv.ros.messages import excerpt

REJECT_LOG_EVERY_S = 2.0  # the same rejection reason is logged at most this often

SUCCESS = TransitionCallbackReturn.SUCCESS
FAILURE = TransitionCallbackReturn.FAILURE


class EmbodiedNode(LifecycleNode):
    """A LifecycleNode over the shared engine. Subclasses declare their own parameters
    in `declare_node_parameters` and implement the setup/teardown/start/stop hooks."""

    NAME = ""

    def __init__(self, node_name: str, host: EngineHost | None = None, **kwargs) -> None:
        # Declared before super().__init__: rclpy may call back into the node.
        self.host = host or EngineHost()  # standalone node: an engine of its own
        self.engine: Engine | None = None
        self.preset: str | None = None
        self.control_rate_hz: float | None = None
        self.active = False
        self._rejections: dict[str, float] = {}
        super().__init__(node_name, **kwargs)
        for spec in ENGINE_PARAMS:
            self.declare_parameter(
                spec.name,
                spec.default,
                ParameterDescriptor(description=spec.description, dynamic_typing=True),
            )
        self.declare_node_parameters()

    # -- hooks ---------------------------------------------------------------------------

    def declare_node_parameters(self) -> None: ...

    def setup(self) -> None:
        """configure: create publishers and subscriptions; raise ValueError to refuse."""

    def teardown(self) -> None:
        """cleanup: destroy what setup created."""

    def start(self) -> None:
        """activate: start output."""

    def stop(self) -> None:
        """deactivate: stop output, keep state."""

    # -- transitions -------------------------------------------------------------------

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            cfg = engine_config(self.param)
        except ValueError as e:
            self.get_logger().error(f"configure refused: {e}")
            return FAILURE
        built = self.host.engine is None
        try:
            self.engine = self.host.acquire(self.get_name(), cfg, self.get_logger().error)
        except Exception as e:
            self.get_logger().error(f"configure failed: engine: {type(e).__name__}: {e}")
            return FAILURE
        try:
            self.setup()
        except Exception as e:
            self.get_logger().error(f"configure failed: {type(e).__name__}: {e}")
            self._release()
            return FAILURE
        self.preset, self.control_rate_hz = cfg.preset, cfg.control_hz
        heap.settle(collect=built)  # no full GC pause of the startup heap (ros/heap.py)
        self.get_logger().info(f"configured (preset={cfg.preset}, {cfg.control_hz:g} Hz)")
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)
        if result != SUCCESS:
            return result
        try:
            self.start()
        except Exception as e:
            self.get_logger().error(f"activate failed: {type(e).__name__}: {e}")
            super().on_deactivate(state)
            return FAILURE
        self.active = True
        self.get_logger().info("activated")
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self._quietly(self.stop, "deactivate")
        self.get_logger().info("deactivated")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        self.get_logger().info("cleaned up")
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self.active:
            self.active = False
            self._quietly(self.stop, "shutdown")
        if self.configured:
            self._release()
        return SUCCESS

    @property
    def configured(self) -> bool:
        """True in the inactive and active states."""
        return self.engine is not None

    # -- helpers -------------------------------------------------------------------------

    def param(self, name: str):
        return self.get_parameter(name).value

    def reject(self, kind: str, reason: str, key: str = "") -> None:
        """A bad input: counted for /diagnostics and logged (each distinct reason, or
        `key` when the reason quotes the input, at most every REJECT_LOG_EVERY_S, so a
        stream of bad input cannot flood the log)."""
        self.host.inputs_rejected[kind] += 1
        now = time.monotonic()
        key = re.sub(r"\d+", "#", key or reason)  # counts in a reason do not make it new
        if now - self._rejections.get(key, -REJECT_LOG_EVERY_S) >= REJECT_LOG_EVERY_S:
            self._rejections[key] = now
            self.get_logger().warning(f"rejected {kind}: {reason}")

    def too_long(self, kind: str, what: str, text: str, param: str, after: str = "") -> bool:
        """True, with the input rejected, when `text` is longer than the node parameter
        `param` (a length limit from the YAML): checked before any other work on the
        text, logged with a short excerpt only."""
        limit = self.param(param)
        if len(text) <= limit:
            return False
        self.reject(
            kind,
            f"{what} of {len(text)} chars > {param}={limit}: {excerpt(text)}{after}",
            key=f"{what} over {param}",
        )
        return True

    def _release(self) -> None:
        self._quietly(self.teardown, "cleanup")
        heap.thaw()  # the engine's objects collectable again if this frees it
        if self.engine is not None and self.host.release(self.get_name()):
            self.get_logger().info("engine freed (last user)")
        elif self.host.engine is not None:
            heap.settle(collect=False)
        self.engine = None
        self.preset = None
        self.control_rate_hz = None

    def _quietly(self, hook, what: str) -> None:
        try:
            hook()
        except Exception as e:
            self.get_logger().error(f"{what}: {type(e).__name__}: {e}")
