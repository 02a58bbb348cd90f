"""The scripted expert: a reactive pick-and-place controller, and its action chunks.

A chunk is the controller run forward on a copy of the scene (the physics is
deterministic), so chunk step k is what the expert would command k steps ahead.

Two labellings of the same motion (`ACTION_LABELS`):
    targets    the controller's commands: far targets the physics reaches at its speed
               limit (the arm's z target flips between +1 and -1 between phases, so
               consecutive actions differ by up to 2 while the arm moves 0.25-0.5)
    waypoints  the arm's position after each step, within one step's reach: commanding it
               moves the arm exactly as the target did (Scene.step's clip never binds), and
               consecutive actions differ by the arm's own motion, as a real robot's
               joint-position targets do (the `world_smooth` preset's labels)"""

from __future__ import annotations

import numpy as np

from embodied_kv.world.scene import ACTION_DIM, LOW_Z, Scene
from embodied_kv.world.tasks import PutTask

HIGH_Z = 1.0
ON_TARGET = 0.04  # xy distance that counts as over a target
# the expert's phases grouped as the task's stages (per-phase errors in train and eval)
STAGES = {"moves": "approach", "lowers": "grasp", "grasps": "grasp", "carries": "carry",
          "releases": "release", "done": "done"}  # fmt: skip
ACTION_LABELS = ("targets", "waypoints")
PRESET_LABELS = {"world_smooth": "waypoints"}  # model preset -> its labels; else targets
MAX_EXPERT_STEPS = 100  # the expert succeeds within ~15-30 steps from any start


def steps_to_success(scene: Scene, task: PutTask) -> int:
    """Expert steps from `scene` until `task` succeeds (MAX_EXPERT_STEPS if it does not);
    `scene` is not changed."""
    sim = scene.copy()
    for n in range(MAX_EXPERT_STEPS):
        if task.success(sim):
            return n
        sim.step(expert_action(sim, task)[0])
    return MAX_EXPERT_STEPS


def expert_action(scene: Scene, task: PutTask) -> tuple[np.ndarray, str]:
    """-> (action [ACTION_DIM], phase) with phase one of
    moves / lowers / grasps / carries / releases / done (the narration's verb)."""
    a = scene.arm
    act = np.zeros(ACTION_DIM)
    if task.success(scene):
        act[:4] = (a.x, a.y, HIGH_Z, -1.0)
        return act, "done"
    if a.holding == task.movable:
        c = scene.get(task.container)
        if np.hypot(c.x - a.x, c.y - a.y) > ON_TARGET:
            act[:4] = (c.x, c.y, HIGH_Z, 1.0)
            return act, "carries"
        act[:4] = (c.x, c.y, a.z, -1.0)
        return act, "releases"
    m = scene.get(task.movable)
    if a.holding is not None or a.closed:  # holding the wrong thing, or closed on nothing
        act[:4] = (a.x, a.y, HIGH_Z, -1.0)
        return act, "moves"
    if np.hypot(m.x - a.x, m.y - a.y) > ON_TARGET:
        act[:4] = (m.x, m.y, HIGH_Z if a.z > LOW_Z else a.z + 0.5, -1.0)
        return act, "moves"
    if a.z > LOW_Z:
        act[:4] = (m.x, m.y, -1.0, -1.0)
        return act, "lowers"
    act[:4] = (m.x, m.y, -1.0, 1.0)
    return act, "grasps"


def labels_of(preset: str) -> str:
    """The labelling a model preset was trained on (ACTION_LABELS)."""
    return PRESET_LABELS.get(preset, "targets")


def expert_chunk(scene: Scene, task: PutTask, horizon: int, labels: str = "targets") -> np.ndarray:
    """The next `horizon` expert actions -> [horizon, ACTION_DIM] in `labels` (ACTION_LABELS);
    `scene` is not changed."""
    if horizon < 1:
        raise ValueError(f"horizon {horizon} must be >= 1")
    if labels not in ACTION_LABELS:
        raise ValueError(f"labels {labels!r}: one of {ACTION_LABELS}")
    sim = scene.copy()
    out = np.zeros((horizon, ACTION_DIM))
    for k in range(horizon):
        out[k], _ = expert_action(sim, task)
        sim.step(out[k])
        if labels == "waypoints":
            out[k, :3] = (sim.arm.x, sim.arm.y, sim.arm.z)
    return out
