"""Instructions and their success checks: "put the red block in the blue bowl"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.scene import Scene, make_scene


@dataclass(frozen=True)
class PutTask:
    movable: str  # e.g. "red block"
    container: str  # e.g. "blue bowl"

    @property
    def instruction(self) -> str:
        return f"put the {self.movable} in the {self.container}"

    def success(self, scene: Scene) -> bool:
        """The movable rests in the container and the gripper has let go of it."""
        return scene.get(self.movable).inside == self.container and scene.arm.holding is None


def sample_task(scene: Scene, rng: np.random.Generator) -> PutTask:
    """A movable not yet in the chosen container (so the task is never done at start)."""
    pairs = [
        (m.name, c.name) for m in scene.movables for c in scene.containers if m.inside != c.name
    ]
    if not pairs:
        raise ValueError("every movable is already in every container")
    m, c = pairs[rng.integers(len(pairs))]
    return PutTask(m, c)


def episode(scene_seed: int) -> tuple[Scene, PutTask]:
    """World episode `scene_seed`: its scene and task (eval's held-out items, the states
    the policy visits in world/visited.py)."""
    rng = np.random.default_rng(scene_seed)
    scene = make_scene(rng)
    return scene, sample_task(scene, rng)
