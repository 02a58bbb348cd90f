"""Training chunks for training-time real-time chunking: d actions already executed, and
the expert's continuation from where they leave the robot.

At inference (`rtc.guidance: prefix`, model/rtc_prefix.py) the new chunk's first d rows
are the old chunk's actions for the ticks the robot executes while the new one is
computed: the policy's earlier plan, not necessarily what the expert would do from the
observation. A chunk whose held rows are the expert's own plan teaches nothing about them
(the observation alone decides the rest), so the policy ignores a prefix that departs from
its plan and its first free action jumps. Here the held rows are the actions executed, on
a share of samples a detour from the expert's plan (`DETOURS`), and the rows after them
are the expert's chunk from the state those actions reach (the world is deterministic):
the continuation of what the robot did, within one step's reach of it."""

from __future__ import annotations

import numpy as np

from embodied_kv.world.expert import expert_chunk
from embodied_kv.world.scene import Scene
from embodied_kv.world.tasks import PutTask

# how an executed prefix departs from the expert's plan:
#   shift  the plan k rows ahead (a plan that ran ahead of the arm) or behind (the arm
#          held where it is for the first rows), k in +-1..MAX_SHIFT
#   drift  the plan plus an offset growing to DRIFT_XY (x, y) and DRIFT_Z (z) at row d-1
DETOURS = ("shift", "drift")
MAX_SHIFT = 3
DRIFT_XY = 0.3
DRIFT_Z = 0.4


def executed_chunk(scene: Scene, task: PutTask, horizon: int, labels: str, held: int,
                   detour: bool, rng: np.random.Generator) -> np.ndarray:  # fmt: skip
    """[horizon, ACTION_DIM]: rows < held the actions executed from `scene` (the expert's
    plan, or with `detour` a departure from it drawn from `rng`), the rest the expert's
    chunk from the state they reach, in `labels` (expert.ACTION_LABELS). held = 0: the
    expert's chunk; without a detour: the expert's chunk (its rows are what it executes).
    `scene` is not changed."""
    if not 0 <= held <= horizon:
        raise ValueError(f"held {held} must be in [0, horizon {horizon}]")
    plan = expert_chunk(scene, task, horizon, labels)
    if held == 0 or not detour:
        return plan
    prefix = detoured(scene, plan, held, rng)
    sim = scene.copy()
    for row in prefix:
        sim.step(row)
    out = plan.copy()
    out[:held] = prefix
    if held < horizon:
        out[held:] = expert_chunk(sim, task, horizon - held, labels)
    return out


def detoured(scene: Scene, plan: np.ndarray, held: int, rng: np.random.Generator) -> np.ndarray:
    """The first `held` rows of `plan` departed from by a DETOURS kind drawn from `rng`."""
    kind = DETOURS[int(rng.integers(len(DETOURS)))]
    if kind == "shift":
        k = int(rng.integers(1, MAX_SHIFT + 1)) * (1 if rng.random() < 0.5 else -1)
        a = scene.arm
        here = plan[0].copy()  # the arm held where it is, its gripper as it is
        here[:4] = (a.x, a.y, a.z, 1.0 if a.closed else -1.0)
        rows = [plan[min(i + k, len(plan) - 1)] if i + k >= 0 else here for i in range(held)]
        return np.stack(rows)  # a new array: `plan` is not changed
    r = DRIFT_XY * np.sqrt(rng.random())
    phi = rng.uniform(0, 2 * np.pi)
    offset = np.array([r * np.cos(phi), r * np.sin(phi), rng.uniform(-DRIFT_Z, DRIFT_Z)])
    out = plan[:held].copy()
    ramp = (np.arange(1, held + 1) / held)[:, None]
    out[:, :3] = np.clip(out[:, :3] + ramp * offset, -1.0, 1.0)
    return out
