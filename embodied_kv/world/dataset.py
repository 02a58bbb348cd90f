"""Training samples from the world for the three losses, seeded and reproducible.

Every sample is one observation along an expert rollout (images, state, instruction),
the expert's action chunk from there (flow-matching target) and one text target,
appended after the frame's prompt exactly as the engine appends it:

    answer    '\nQuestion: <q>\nAnswer: '                 -> '<answer>'   (engine/policy.py)
    plan      '\nFacts: ...\nQuery: <q>\nAnswer: '         -> '<place>'
    narration ''                                          -> '<sentence>'
    actions   ''                                          -> the chunk's `bins` action
              tokens (train/batch.py encodes them: the autoregressive action mode)

Every sample also carries per-patch class labels of its cameras (render.patch_labels):
the dense target of an auxiliary loss on the image tokens, as pi0.5 co-trains its VLM
on object detection — one label per patch instead of one answer word per question.

Answers and plans carry `turns` questions about the same scene / facts: the first is
laid out exactly as the engine asks it, the others follow it ('\nQuestion: ...' again,
after the previous answer's EOS) — more answers per prefill, the same format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.expert import expert_action, expert_chunk
from embodied_kv.world.memory import ANSWER_FORMS, sample_queries
from embodied_kv.world.narration import narrate
from embodied_kv.world.questions import sample_question
from embodied_kv.world.render import observation_images, patch_labels
from embodied_kv.world.scene import ACTION_DIM, make_scene
from embodied_kv.world.tasks import sample_task
from embodied_kv.world.vocab import COLOURS, CONTAINERS

TEXT_KINDS = ("answer", "plan", "narration", "actions")
MAX_OBJECTS = len(COLOURS) * len(CONTAINERS)  # distinct containers the vocabulary names


@dataclass(frozen=True)
class DataConfig:
    image_size: int = 64  # world preset: VisionConfig.image_size
    patch: int = 8  # world preset: VisionConfig.patch_size (the patch labels' grid)
    horizon: int = 10  # world preset: action_horizon
    # answer, plan, narration, actions (the `bins` tokens of the chunk)
    text_mix: tuple[float, ...] = (0.3, 0.35, 0.1, 0.25)
    turns: int = 4  # questions per answer / plan sample
    two_hop_share: float = 0.5  # of plan queries
    memory_updates: int = 6  # fact updates after the initial facts: 0 .. this, uniform
    memory_objects: int = 3  # containers and movables in a fact stream: 2 .. this each
    # share of memory queries whose answer is not the last place the facts name (there
    # the recency shortcut, copying that place, is wrong); 0 = as the queries come
    memory_hard: float = 0.0
    two_hop_answer: str = "place"  # or "path": 'in the <container> on the <place>' (memory.py)
    max_rollout: int = 20  # expert steps before the sampled observation
    perturb: float = 0.3  # share of rollouts that start with random actions (recovery)

    def __post_init__(self):
        if len(self.text_mix) != len(TEXT_KINDS) or min(self.text_mix) < 0 or sum(
            self.text_mix
        ) <= 0:
            raise ValueError(f"text_mix {self.text_mix} needs {len(TEXT_KINDS)} weights >= 0, "
                             f"not all 0 ({TEXT_KINDS})")  # fmt: skip
        if not all(0 <= x <= 1 for x in (self.two_hop_share, self.perturb, self.memory_hard)):
            raise ValueError(f"shares must be in [0, 1]: {self}")
        if self.horizon < 1 or self.max_rollout < 0 or self.memory_updates < 0:
            raise ValueError(f"bad data config: {self}")
        if self.two_hop_answer not in ANSWER_FORMS:
            raise ValueError(f"two_hop_answer {self.two_hop_answer!r}: one of {ANSWER_FORMS}")
        if self.turns < 1 or not 2 <= self.memory_objects <= MAX_OBJECTS:
            raise ValueError(f"turns >= 1 and memory_objects in [2, {MAX_OBJECTS}]: {self}")


@dataclass(frozen=True)
class Sample:
    images: np.ndarray  # [cameras, 3, S, S] float32 in [-1, 1]
    state: np.ndarray  # [STATE_DIM]
    instruction: str
    actions: np.ndarray  # [horizon, ACTION_DIM] expert chunk
    kind: str  # one of TEXT_KINDS
    turns: tuple[tuple[str, str], ...]  # (text after the prompt or the previous EOS, target)
    patches: np.ndarray  # [cameras, patches] class ids (render.LABELS): the auxiliary target

    @property
    def suffix(self) -> str:
        """The first turn's text: what the engine appends to the prompt."""
        return self.turns[0][0] if self.turns else ""

    @property
    def target(self) -> str:
        return self.turns[0][1] if self.turns else ""


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
    mix = np.asarray(cfg.text_mix) / sum(cfg.text_mix)
    kind = TEXT_KINDS[rng.choice(len(TEXT_KINDS), p=mix)]
    turns: list[tuple[str, str]] = []
    if kind == "answer":
        for _ in range(cfg.turns):
            qa = sample_question(scene, rng)
            turns.append((f"\nQuestion: {qa.question}\nAnswer: ", qa.answer))
    elif kind == "plan":
        hops = [2 if rng.random() < cfg.two_hop_share else 1 for _ in range(cfg.turns)]
        n_c, n_m = (int(rng.integers(2, cfg.memory_objects + 1)) for _ in range(2))
        updates = int(rng.integers(0, cfg.memory_updates + 1))
        queries = sample_queries(rng, hops, n_c, n_m, updates, cfg.memory_hard)
        turns = [(q.prompt if i == 0 else q.follow_up, q.target(cfg.two_hop_answer))
                 for i, q in enumerate(queries)]  # fmt: skip
    elif kind == "narration":
        turns = [("", narrate(phase, task))]
    return Sample(
        images=observation_images(scene, cfg.image_size),
        state=scene.state(),
        instruction=task.instruction,
        actions=expert_chunk(scene, task, cfg.horizon),
        kind=kind,
        turns=tuple(turns),
        patches=patch_labels(scene, cfg.image_size, cfg.patch),
    )
