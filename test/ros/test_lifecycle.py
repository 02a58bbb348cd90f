"""The package's lifecycle nodes, driven through the standard lifecycle_msgs
ChangeState / GetState services from another node in another DDS participant."""

from __future__ import annotations

import pytest

ROS_SKIP_REASON = "rclpy is not importable (no ROS 2 here; `make test` installs it into .venv)"
pytest.importorskip("rclpy", reason=ROS_SKIP_REASON)

from lifecycle_msgs.msg import State, Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402

from embodied_kv.ros.container import NODE_CLASSES  # noqa: E402

WALK = [  # transition -> the primary state it must reach
    (Transition.TRANSITION_CONFIGURE, State.PRIMARY_STATE_INACTIVE),
    (Transition.TRANSITION_ACTIVATE, State.PRIMARY_STATE_ACTIVE),
    (Transition.TRANSITION_DEACTIVATE, State.PRIMARY_STATE_INACTIVE),
    (Transition.TRANSITION_CLEANUP, State.PRIMARY_STATE_UNCONFIGURED),
]


class RemoteLifecycle:
    """Another node's view of a lifecycle node: only its standard services."""

    def __init__(self, ros, caller, node_fqn: str) -> None:
        self._ros = ros
        self._change = caller.create_client(ChangeState, f"{node_fqn}/change_state")
        self._get = caller.create_client(GetState, f"{node_fqn}/get_state")

    def change(self, transition_id: int) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition_id))
        return self._ros.call(self._change, request).success

    def state(self) -> int:
        return self._ros.call(self._get, GetState.Request()).current_state.id


def start(ros, node_class, **kwargs):
    owner = ros.participant()
    node = owner.add(node_class(context=owner.context, namespace=ros.namespace, **kwargs))
    caller = ros.participant().node("lifecycle_caller", ros.namespace)
    remote = RemoteLifecycle(ros, caller, node.get_fully_qualified_name())
    return node, remote


@pytest.mark.parametrize("node_class", NODE_CLASSES, ids=[c.NAME for c in NODE_CLASSES])
def test_walk_configure_activate_deactivate_cleanup(ros, node_class):
    node, remote = start(ros, node_class)
    assert remote.state() == State.PRIMARY_STATE_UNCONFIGURED
    for transition_id, expected in WALK:
        assert remote.change(transition_id), f"transition {transition_id} refused"
        assert remote.state() == expected
        assert node.configured == (expected != State.PRIMARY_STATE_UNCONFIGURED)
        assert node.active == (expected == State.PRIMARY_STATE_ACTIVE)
    assert node.preset is None  # cleanup released what configure made


def test_refused_transition_is_reported_and_changes_nothing(ros):
    node, remote = start(ros, NODE_CLASSES[0])
    assert not remote.change(Transition.TRANSITION_ACTIVATE)  # not configured yet
    assert remote.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert not remote.change(Transition.TRANSITION_CLEANUP)
    assert remote.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert remote.change(Transition.TRANSITION_CONFIGURE)  # the node is still usable
    assert remote.state() == State.PRIMARY_STATE_INACTIVE
    assert node.preset == "tiny"


def test_failing_configure_leaves_node_alive_and_unconfigured(ros):
    bad_rate = [Parameter("control_rate_hz", value=-5.0)]
    node, remote = start(ros, NODE_CLASSES[0], parameter_overrides=bad_rate)
    assert not remote.change(Transition.TRANSITION_CONFIGURE)
    assert remote.state() == State.PRIMARY_STATE_UNCONFIGURED
    assert not node.configured


def test_parameters_reach_the_node(ros):
    overrides = [Parameter("control_rate_hz", value=20.0)]
    node, remote = start(ros, NODE_CLASSES[0], parameter_overrides=overrides)
    assert remote.change(Transition.TRANSITION_CONFIGURE)
    assert (node.preset, node.control_rate_hz) == ("tiny", 20.0)
