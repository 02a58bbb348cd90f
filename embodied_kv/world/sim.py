"""The simulated robot's world (`make demo`): a stream of seeded episodes in the tabletop
scene, the robot's actions applied through `Scene.step`, each episode ended by its task's
success or a step limit, then the next one begins. Numpy only: the ROS side
(ros/sim_robot.py) publishes what this renders and feeds it the `action` topic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.expert import STAGES, expert_action
from embodied_kv.world.render import CAMERAS, render
from embodied_kv.world.scene import Scene, make_scene
from embodied_kv.world.tasks import PutTask, sample_task

MAX_STEPS = 200  # actions per episode before it counts as failed (4 s at 50 Hz; the expert
# needs ~20-30)


@dataclass(frozen=True)
class EpisodeResult:
    index: int
    instruction: str
    success: bool
    steps: int  # actions applied
    # the task's stage where it ended (expert.STAGES of the expert's phase there): "done"
    # on success; where a failed one was stuck (approach, grasp, carry, release)
    stage: str = ""


class WorldSim:
    def __init__(self, seed: int, max_steps: int = MAX_STEPS):
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps} must be >= 1")
        self.seed, self.max_steps = seed, max_steps
        self.results: list[EpisodeResult] = []
        self.index = -1
        self.scene: Scene
        self.task: PutTask
        self.steps = 0
        self._begin_next()

    def _begin_next(self) -> None:
        self.index += 1
        rng = np.random.default_rng(self.seed + self.index)
        self.scene = make_scene(rng)
        self.task = sample_task(self.scene, rng)
        self.steps = 0

    @property
    def instruction(self) -> str:
        return self.task.instruction

    def apply(self, action) -> bool:
        """One action [>= 4] (scene.py: absolute targets); True when it ended the episode
        and the next one began (its instruction is new). ValueError for a bad action."""
        self.scene.step(np.asarray(action, dtype=np.float64))
        self.steps += 1
        success = self.task.success(self.scene)
        if not success and self.steps < self.max_steps:
            return False
        stage = STAGES[expert_action(self.scene, self.task)[1]]
        self.results.append(EpisodeResult(self.index, self.instruction, success, self.steps,
                                          stage))  # fmt: skip
        self._begin_next()
        return True

    def image(self, camera: str, size: int) -> np.ndarray:
        """[size, size, 3] uint8 of one of render.CAMERAS."""
        return render(self.scene, camera, size)

    def state(self) -> np.ndarray:
        return self.scene.state()

    def successes(self) -> int:
        return sum(r.success for r in self.results)


def camera_of(name: str, index: int) -> str:
    """The world camera a configured camera shows: its own name when the world has it,
    else the world's camera at the same index."""
    if name in CAMERAS:
        return name
    if index >= len(CAMERAS):
        raise ValueError(f"camera {name!r} (#{index}): the world renders only {CAMERAS}")
    return CAMERAS[index]
