"""Training samples from the world for the three losses, seeded and reproducible.

Every sample is one observation along an expert rollout (images, state, instruction),
the expert's action chunk from there (flow-matching target) and one text target,
appended after the frame's prompt exactly as the engine appends it:

    answer    suffix '\\nQuestion: <q>\\nAnswer: '  target '<answer>'   (engine/policy.py)
    plan      suffix '\\nFacts: ...\\nQuery: <q>\\nAnswer: '  target '<place>'
    narration suffix ''                             target '<sentence>'
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.expert import expert_action, expert_chunk
from embodied_kv.world.memory import sample_query
from embodied_kv.world.narration import narrate
from embodied_kv.world.questions import sample_question
from embodied_kv.world.render import observation_images
from embodied_kv.world.scene import ACTION_DIM, make_scene
from embodied_kv.world.tasks import sample_task

TEXT_KINDS = ("answer", "plan", "narration")


@dataclass(frozen=True)
class DataConfig:
    image_size: int = 64  # world preset: VisionConfig.image_size
    horizon: int = 10  # tiny preset: action_horizon
    text_mix: tuple[float, float, float] = (0.4, 0.4, 0.2)  # answer, plan, narration
    two_hop_share: float = 0.5  # of plan samples
    memory_updates: int = 1  # fact updates after the initial facts
    max_rollout: int = 20  # expert steps before the sampled observation
    perturb: float = 0.3  # share of rollouts that start with random actions (recovery)

    def __post_init__(self):
        if len(self.text_mix) != 3 or min(self.text_mix) < 0 or sum(self.text_mix) <= 0:
            raise ValueError(f"text_mix {self.text_mix} needs 3 weights >= 0, not all 0")
        if not 0 <= self.two_hop_share <= 1 or not 0 <= self.perturb <= 1:
            raise ValueError(f"shares must be in [0, 1]: {self}")
        if self.horizon < 1 or self.max_rollout < 0 or self.memory_updates < 0:
            raise ValueError(f"bad data config: {self}")


@dataclass(frozen=True)
class Sample:
    images: np.ndarray  # [cameras, 3, S, S] float32 in [-1, 1]
    state: np.ndarray  # [STATE_DIM]
    instruction: str
    actions: np.ndarray  # [horizon, ACTION_DIM] expert chunk
    kind: str  # one of TEXT_KINDS
    suffix: str  # text after the prompt (question / facts + query / '')
    target: str  # the text to generate (EOS follows)


def make_sample(cfg: DataConfig, seed: int) -> Sample:
    """Sample number `seed`: a pure function of (cfg, seed)."""
    rng = np.random.default_rng(seed)
    scene = make_scene(rng)
    task = sample_task(scene, rng)
    if rng.random() < cfg.perturb:
        for _ in range(int(rng.integers(1, 4))):
            act = np.zeros(ACTION_DIM)
            act[:4] = rng.uniform(-1, 1, size=4)
            scene.step(act)
    for _ in range(int(rng.integers(0, cfg.max_rollout + 1))):
        act, _ = expert_action(scene, task)
        scene.step(act)
    _, phase = expert_action(scene, task)
    kind = TEXT_KINDS[rng.choice(3, p=np.asarray(cfg.text_mix) / sum(cfg.text_mix))]
    if kind == "answer":
        qa = sample_question(scene, rng)
        suffix, target = f"\nQuestion: {qa.question}\nAnswer: ", qa.answer
    elif kind == "plan":
        hops = 2 if rng.random() < cfg.two_hop_share else 1
        mq = sample_query(rng, hops, n_updates=cfg.memory_updates)
        suffix, target = mq.prompt, mq.answer
    else:
        suffix, target = "", narrate(phase, task)
    return Sample(
        images=observation_images(scene, cfg.image_size),
        state=scene.state(),
        instruction=task.instruction,
        actions=expert_chunk(scene, task, cfg.horizon),
        kind=kind,
        suffix=suffix,
        target=target,
    )
