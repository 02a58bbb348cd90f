"""The standard lifecycle services (ChangeState / GetState) walk every node of the
running robot through deactivate / cleanup / configure / activate."""

from __future__ import annotations

import time

from lifecycle_msgs.msg import State, Transition

from embodied_kv.ros.container import NODE_CLASSES
from embodied_kv.srv import ListCapsules, Reset, Rollback, Snapshot

NAMES = [cls.NAME for cls in NODE_CLASSES]
SERVICES = [
    ("snapshot", Snapshot.Request(name="x", tier=0)),
    ("reset", Reset.Request()),
    ("rollback", Rollback.Request(steps_back=1)),
    ("list_capsules", ListCapsules.Request()),
]


def walk(robot, names, transition: int, expected: int) -> None:
    for name in names:
        assert robot.change_state(name, transition), f"{name}: transition {transition} refused"
        assert robot.state(name) == expected, name


def services_refuse(robot, state: str) -> None:
    for service, request in SERVICES:
        response = robot.call(service, request)
        assert not response.success, f"{service} while {state}"
        assert f"kv_manager is {state}" in response.message, response.message


def test_walk_every_node_and_services_refuse_while_not_active(robot):
    assert robot.all_active()
    walk(robot, reversed(NAMES), Transition.TRANSITION_DEACTIVATE, State.PRIMARY_STATE_INACTIVE)
    services_refuse(robot, "inactive")
    time.sleep(0.3)
    since = time.monotonic()
    time.sleep(0.5)
    assert robot.actions.count(since) == 0, "deactivate must stop the action output"

    walk(robot, reversed(NAMES), Transition.TRANSITION_CLEANUP, State.PRIMARY_STATE_UNCONFIGURED)
    services_refuse(robot, "unconfigured")
    robot.wait_until(lambda: "engine freed (last user)" in robot.robot.log(), "engine freed")

    walk(robot, NAMES, Transition.TRANSITION_CONFIGURE, State.PRIMARY_STATE_INACTIVE)
    walk(robot, NAMES, Transition.TRANSITION_ACTIVATE, State.PRIMARY_STATE_ACTIVE)
    robot.observe()  # a new engine: the inputs start over too
    robot.wait_for_actions(25)
    response = robot.call("reset", Reset.Request())
    assert response.success, response.message


def test_deactivate_keeps_state_for_the_next_activate(robot):
    start = time.monotonic()
    robot.wait_until(lambda: robot.chunks[-1][0] > start, "a fresh action chunk")
    assert robot.call("snapshot", Snapshot.Request(name="before_pause", tier=0)).success
    walk(robot, reversed(NAMES), Transition.TRANSITION_DEACTIVATE, State.PRIMARY_STATE_INACTIVE)
    time.sleep(0.3)  # the last chunk, published while action_expert stopped, arrives
    seen = len(robot.chunks)
    last_frame = int(robot.chunks[-1][1].header.frame_id)
    walk(robot, NAMES, Transition.TRANSITION_ACTIVATE, State.PRIMARY_STATE_ACTIVE)
    robot.wait_until(lambda: len(robot.chunks) > seen, "a chunk after activate")
    assert int(robot.chunks[seen][1].header.frame_id) == last_frame + 1  # no new episode
    assert "before_pause" in robot.call("list_capsules", ListCapsules.Request()).names
    robot.wait_for_actions()
