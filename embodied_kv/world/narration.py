"""Narrations: what the arm is doing now, from the expert's phase of the task."""

from __future__ import annotations

from embodied_kv.world.tasks import PutTask

TEMPLATES = {
    "moves": "the arm moves to the {m} .",
    "lowers": "the arm lowers to the {m} .",
    "grasps": "the arm grasps the {m} .",
    "carries": "the arm carries the {m} to the {c} .",
    "releases": "the arm releases the {m} in the {c} .",
    "done": "done : the {m} is in the {c} .",
}


def narrate(phase: str, task: PutTask) -> str:
    """The expert's phase (expert.expert_action) -> one sentence."""
    if phase not in TEMPLATES:
        raise ValueError(f"unknown phase {phase!r}; known {sorted(TEMPLATES)}")
    return TEMPLATES[phase].format(m=task.movable, c=task.container)
