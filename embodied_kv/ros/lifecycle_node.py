"""Lifecycle base of the five nodes (DESIGN §5), in the ros2/demos lifecycle_py style.

`on_configure` creates what a node needs and `on_cleanup` destroys it;
`on_activate` / `on_deactivate` call `super()`, which switches lifecycle
publishers. A transition that fails returns FAILURE with a logged reason: the
node stays alive in its previous state (STYLE 7).
"""

from __future__ import annotations

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

DEFAULT_PRESET = "tiny"
DEFAULT_CONTROL_RATE_HZ = 50.0


class EmbodiedNode(LifecycleNode):
    """A LifecycleNode with the parameters every node of the robot shares.

    Subclasses extend `on_configure` / `on_cleanup` (call `super()` first / last)
    and keep their own resources as attributes declared in `__init__`.
    """

    def __init__(self, node_name: str, **kwargs) -> None:
        # Declared before super().__init__: rclpy may call back into the node.
        self.preset: str | None = None
        self.control_rate_hz: float | None = None
        self.active = False
        super().__init__(node_name, **kwargs)
        self.declare_parameter(
            "preset",
            DEFAULT_PRESET,
            ParameterDescriptor(description="model preset (DESIGN §6): tiny | pi05"),
        )
        self.declare_parameter(
            "control_rate_hz",
            DEFAULT_CONTROL_RATE_HZ,
            ParameterDescriptor(description="action publishing rate, Hz"),
        )

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        preset = self.get_parameter("preset").value
        rate = self.get_parameter("control_rate_hz").value
        if not preset:
            self.get_logger().error("configure refused: parameter preset is empty")
            return TransitionCallbackReturn.FAILURE
        if rate <= 0.0:
            self.get_logger().error(f"configure refused: control_rate_hz={rate} must be > 0")
            return TransitionCallbackReturn.FAILURE
        self.preset = preset
        self.control_rate_hz = rate
        self.get_logger().info(f"configured (preset={preset}, control_rate_hz={rate})")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)
        self.active = result == TransitionCallbackReturn.SUCCESS
        self.get_logger().info("activated")
        return result

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self.get_logger().info("deactivated")
        return super().on_deactivate(state)

    @property
    def configured(self) -> bool:
        """True in the inactive and active states."""
        return self.preset is not None

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.preset = None
        self.control_rate_hz = None
        self.get_logger().info("cleaned up")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self.preset = None
        self.control_rate_hz = None
        return TransitionCallbackReturn.SUCCESS
