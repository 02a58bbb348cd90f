"""What `eval world` drives: one interface over the engine's schedulers.

    begin()                                   a new episode (empty slots, requests, memory)
    act(scene, instruction, cycle) -> chunk   [H, A] robot actions for the scene as it is
    submit(scene, instruction, text, kind)    a question (ANSWER) or memory query (PLAN)
    finish(request_id) -> text                the request's finished text

`EngineRunner` is the product path: `Engine.cycle` (OxyGen's unified loop in `flow` mode,
ActionFlow's pipeline in `ar` mode). `IsolatedEval` is the isolated baseline
(engine/isolated.py): every task on its own prefill. Both see the same observations,
built from the numpy world exactly as the demo's simulated robot renders them."""

from __future__ import annotations

import numpy as np
import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.engine import Engine
from embodied_kv.engine.isolated import IsolatedRunner
from embodied_kv.engine.policy import LoopConfig
from embodied_kv.kv.manager import TaskKind
from embodied_kv.model.vla import Observation
from embodied_kv.world.render import observation_images
from embodied_kv.world.scene import Scene

# flow: a one-word answer + EOS finishes in the cycle after admission (the loop decodes
# until the cycle's deadline); ar: one token per cycle rides on the pipeline's step
EXTRA_CYCLES = 3


def world_observation(scene: Scene, instruction: str, image_size: int) -> Observation:
    """The scene as the model sees it: both cameras [2, 3, S, S] in [-1, 1], the state."""
    images = torch.from_numpy(observation_images(scene, image_size))
    return Observation(images, scene.state(), instruction)


class EngineRunner:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.size = engine.model.cfg.vision.image_size

    @property
    def ar(self) -> bool:
        return self.engine.action_tokens is not None

    def begin(self) -> None:
        self.engine.begin_episode()

    def observe(self, scene: Scene, instruction: str) -> None:
        self.engine.observe(world_observation(scene, instruction, self.size))

    def act(self, scene: Scene, instruction: str, cycle: int) -> np.ndarray:
        """[H, A]; in `ar` mode the frame's action tokens are decoded to the end first
        (the pipeline drained: a closed loop waits for its own observation's action)."""
        self.observe(scene, instruction)
        tick = cycle * self.engine.cfg.replan_every
        result = self.engine.cycle(tick)
        if not self.ar or (result.chunk is not None and result.chunk_tick == tick):
            return result.chunk
        done = [d for d in self.engine.loop.flow.drain() if d.tick == tick]
        if len(done) != 1:
            raise RuntimeError(f"ar: the frame of tick {tick} did not leave the pipeline")
        return self.engine.robot.actions_out(done[0].chunk, done[0].state)

    def submit(self, scene: Scene, instruction: str, text: str, kind: TaskKind) -> str:
        self.observe(scene, instruction)
        request_id, refused = self.engine.ask(text, kind)
        if refused is not None:
            raise ValueError(f"the engine refused an eval request: {refused.reason}")
        return request_id

    def finish(self, request_id: str) -> str:
        cycles = EXTRA_CYCLES + (self.engine.cfg.answer_tokens if self.ar else 1)
        for _ in range(cycles):
            for ev in self.engine.cycle(0).events:
                if ev.request_id == request_id and ev.done:
                    return ev.text.strip()
        raise RuntimeError(f"the engine did not finish {request_id} in {cycles} cycles")


class IsolatedEval:
    """The isolated baseline over the engine's model, policy config and robot units."""

    def __init__(self, engine: Engine):
        if engine.action_tokens is not None:
            raise ValueError("the isolated baseline runs the action expert (flow mode only)")
        cfg, model = engine.cfg, engine.model
        loop = LoopConfig(
            period_s=cfg.period_s, answer_tokens=cfg.answer_tokens, seed=cfg.seed,
            narration_tokens=cfg.narration_tokens, request_tokens=cfg.request_tokens,
        )  # fmt: skip
        queue = ActionQueue(model.cfg.action_horizon, engine.robot.action_dim, cfg.blend)
        rows = engine.manager.arena.spec.max_len
        self.runner = IsolatedRunner(model, queue, loop, rows, robot=engine.robot)
        self.robot, self.size = engine.robot, model.cfg.vision.image_size
        self.replan_every = cfg.replan_every
        self._obs: Observation | None = None
        self._done: dict[str, str] = {}

    def begin(self) -> None:
        self._done.clear()

    def _observe(self, scene: Scene, instruction: str) -> Observation:
        obs = world_observation(scene, instruction, self.size)
        return self.robot.model_observation(obs)

    def act(self, scene: Scene, instruction: str, cycle: int) -> np.ndarray:
        obs = self._observe(scene, instruction)
        return self.runner.cycle(obs, cycle, cycle * self.replan_every).chunk

    def submit(self, scene: Scene, instruction: str, text: str, kind: TaskKind) -> str:
        self._obs = self._observe(scene, instruction)
        return self.runner.policy.ask(text, kind)

    def finish(self, request_id: str) -> str:
        if request_id not in self._done:
            for ev in self.runner.cycle(self._obs, 0, 0).events:  # decodes each to its end
                self._done[ev.request_id] = ev.text.strip()
        return self._done.pop(request_id)


def as_runner(x):
    """An Engine wraps into its EngineRunner (callers that hold an engine: bench vlcache);
    a runner, or None (the scripted expert), stays as it is."""
    return EngineRunner(x) if isinstance(x, Engine) else x
