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

`rollout="task"` (issue 34) draws states that teach the task rather than "stay where the
arm is": only states before the expert's success, `first_share` of them the episode's first
(the pose eval starts from), `arm_start_share` of the episodes from a random high arm pose;
each sample also labels its patches as the named movable / named container / other
(`ground`: the training-only grounding head's target, train/losses.py) and gives each
patch the table (x, y) of the thing it shows (`centres`: the object-centric regression's
target). `visited_share`
(DAgger) draws that share of the samples at states a trained policy visited in closed loop
(world/visited.py), labelled by the expert the same way.

Answers and plans carry `turns` questions about the same scene / facts: the first is
laid out exactly as the engine asks it, the others follow it ('\nQuestion: ...' again,
after the previous answer's EOS) — more answers per prefill, the same format.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from embodied_kv.world.executed_prefix import executed_chunk
from embodied_kv.world.expert import ACTION_LABELS, expert_action, expert_chunk, steps_to_success
from embodied_kv.world.memory import ANSWER_FORMS, sample_queries
from embodied_kv.world.narration import narrate
from embodied_kv.world.questions import sample_question
from embodied_kv.world.render import LABELS, label_of, observation_images, patch_labels
from embodied_kv.world.scene import ACTION_DIM, Scene, make_scene
from embodied_kv.world.tasks import PutTask, sample_task
from embodied_kv.world.visited import load_visited
from embodied_kv.world.vocab import COLOURS, CONTAINERS

TEXT_KINDS = ("answer", "plan", "narration", "actions")
ROLLOUTS = ("fixed", "task")  # 0..max_rollout expert steps | states before the success
GROUND = ("other", "movable", "container")  # grounding classes: the instruction's objects
MAX_OBJECTS = len(COLOURS) * len(CONTAINERS)  # distinct containers the vocabulary names


@dataclass(frozen=True)
class DataConfig:
    image_size: int = 64  # world preset: VisionConfig.image_size
    patch: int = 8  # world preset: VisionConfig.patch_size (the patch labels' grid)
    horizon: int = 10  # world preset: action_horizon
    labels: str = "targets"  # the chunks' labelling (expert.ACTION_LABELS; the preset's labels_of)
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
    rollout: str = "fixed"  # ROLLOUTS; "task": states before the expert's success only
    first_share: float = 0.0  # "task": share of samples at the episode's first state
    arm_start_share: float = 0.0  # "task": share of episodes from a random high arm pose
    where_share: float = 0.0  # share of scene questions "where is the X ?" (left/middle/right)
    # DAgger: a share of the samples at states the policy itself visited (world/visited.py
    # file, eval/visited.py collects it), labelled by the expert; the rest as `rollout`
    visited: str = ""
    visited_share: float = 0.0
    # training-time real-time chunking (world/executed_prefix.py): each sample's first d
    # actions (d uniform in 0..prefix_max) executed before the chunk and given clean, the
    # loss on the rest; on `prefix_detour` of the samples they depart from the expert's plan
    # and the rest is the expert's continuation from where they leave the arm; 0 = off
    prefix_max: int = 0
    prefix_detour: float = 0.0
    # share of those samples drawn with d = 0 before the uniform draw: the plain chunk, what
    # an episode's first chunk and naive switching sample, kept strong
    prefix_free: float = 0.0

    def __post_init__(self):
        if len(self.text_mix) != len(TEXT_KINDS) or min(self.text_mix) < 0 or sum(
            self.text_mix
        ) <= 0:
            raise ValueError(f"text_mix {self.text_mix} needs {len(TEXT_KINDS)} weights >= 0, "
                             f"not all 0 ({TEXT_KINDS})")  # fmt: skip
        if not all(0 <= x <= 1 for x in (self.two_hop_share, self.perturb, self.memory_hard,
                                         self.first_share, self.arm_start_share,
                                         self.where_share, self.visited_share,
                                         self.prefix_detour, self.prefix_free)):  # fmt: skip
            raise ValueError(f"shares must be in [0, 1]: {self}")
        if self.horizon < 1 or self.max_rollout < 0 or self.memory_updates < 0:
            raise ValueError(f"bad data config: {self}")
        if self.two_hop_answer not in ANSWER_FORMS:
            raise ValueError(f"two_hop_answer {self.two_hop_answer!r}: one of {ANSWER_FORMS}")
        if self.labels not in ACTION_LABELS:
            raise ValueError(f"labels {self.labels!r}: one of {ACTION_LABELS}")
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rollout {self.rollout!r}: one of {ROLLOUTS}")
        if self.visited_share > 0 and not self.visited:
            raise ValueError(f"visited_share {self.visited_share} needs a visited states file")
        if self.prefix_max < 0:
            raise ValueError(f"prefix_max {self.prefix_max} must be >= 0")
        if (self.prefix_detour > 0 or self.prefix_free > 0) and self.prefix_max == 0:
            raise ValueError(f"prefix_detour {self.prefix_detour} and prefix_free "
                             f"{self.prefix_free} need prefix_max > 0")  # fmt: skip
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
    ground: np.ndarray  # [cameras, patches] GROUND ids: the instruction's objects per patch
    phase: str  # the expert's phase at this state (expert.STAGES groups them)
    centres: np.ndarray  # [cameras, patches, 2] table (x, y) each patch shows, NaN: none
    # things the text names: (turn index, the naming words, table x, y); turn -1 is the
    # instruction (its movable, then its container), then each question's things
    names: tuple[tuple[int, str, float, float], ...] = ()
    # training-time RTC: the first `held` actions were executed before the chunk (given
    # clean, not scored); None: the run does not train it (DataConfig.prefix_max 0)
    held: int | None = None

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
    if cfg.visited_share > 0 and rng.random() < cfg.visited_share:  # no draw at share 0
        states = load_visited(cfg.visited)
        scene, task = states[int(rng.integers(len(states)))].replay()
    else:
        scene, task = rollout_state(cfg, rng)
    _, phase = expert_action(scene, task)
    mix = np.asarray(cfg.text_mix) / sum(cfg.text_mix)
    kind = TEXT_KINDS[rng.choice(len(TEXT_KINDS), p=mix)]
    turns: list[tuple[str, str]] = []
    names = [(-1, name, (t := scene.get(name)).x, t.y) for name in (task.movable, task.container)]
    if kind == "answer":
        for _ in range(cfg.turns):
            where = cfg.where_share > 0 and rng.random() < cfg.where_share
            qa = sample_question(scene, rng, "where" if where else None)
            names += [(len(turns), *named) for named in qa.named]
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
    held = chunk = None
    if cfg.prefix_max > 0:  # no draw when off: the samples of before
        free = cfg.prefix_free > 0 and rng.random() < cfg.prefix_free  # no draw at 0
        held = 0 if free else int(rng.integers(0, cfg.prefix_max + 1))
        detour = rng.random() < cfg.prefix_detour
        if kind == "actions":  # the `bins` ids of a chunk the observation decides alone
            held = 0
        chunk = executed_chunk(scene, task, cfg.horizon, cfg.labels, held, detour, rng)
    sample = scene_sample(cfg, scene, task, kind, tuple(turns), phase, tuple(names), chunk)
    return sample if held is None else replace(sample, held=held)


def scene_sample(cfg: DataConfig, scene: Scene, task: PutTask, kind: str,
                 turns: tuple[tuple[str, str], ...], phase: str,
                 names: tuple[tuple[int, str, float, float], ...] = (),
                 chunk: np.ndarray | None = None) -> Sample:  # fmt: skip
    """`scene` under `task` rendered as a training sample (images, state, the expert's
    chunk or `chunk`, the patch targets) with the given text; `phase` the expert's phase
    there."""
    patches = patch_labels(scene, cfg.image_size, cfg.patch)
    return Sample(
        images=observation_images(scene, cfg.image_size),
        state=scene.state(),
        instruction=task.instruction,
        actions=expert_chunk(scene, task, cfg.horizon, cfg.labels) if chunk is None else chunk,
        kind=kind,
        turns=turns,
        patches=patches,
        ground=ground_labels(patches, task),
        phase=phase,
        centres=object_centres(scene, patches),
        names=names,
    )


def rollout_state(cfg: DataConfig, rng: np.random.Generator) -> tuple[Scene, PutTask]:
    """A fresh scene and task, moved to a state of the expert's rollout (cfg.rollout)."""
    scene = make_scene(rng)
    task = sample_task(scene, rng)
    if cfg.rollout == "task":
        task_state(cfg, scene, task, rng)
    else:
        if rng.random() < cfg.perturb:
            perturb(scene, rng)
        for _ in range(int(rng.integers(0, cfg.max_rollout + 1))):
            act, _ = expert_action(scene, task)
            scene.step(act)
    return scene, task


def perturb(scene: Scene, rng: np.random.Generator) -> None:
    """1-3 random actions (recovery states)."""
    for _ in range(int(rng.integers(1, 4))):
        act = np.zeros(ACTION_DIM)
        act[:4] = rng.uniform(-1, 1, size=4)
        scene.step(act)


def task_state(cfg: DataConfig, scene: Scene, task: PutTask, rng: np.random.Generator) -> None:
    """Move `scene` to a state of the `task` rollout: the first state (cfg.first_share),
    else from the start pose or a random high arm pose (cfg.arm_start_share), perhaps
    perturbed, 0 .. n-1 expert steps where n steps reach the success."""
    if rng.random() < cfg.first_share:
        return
    if rng.random() < cfg.arm_start_share:
        x, y = rng.uniform(-1.0, 1.0, size=2)
        scene.arm.x, scene.arm.y, scene.arm.z = float(x), float(y), float(rng.uniform(0, 1))
    if rng.random() < cfg.perturb:
        perturb(scene, rng)
    n = steps_to_success(scene, task)
    for _ in range(int(rng.integers(0, max(n, 1)))):
        scene.step(expert_action(scene, task)[0])


def object_centres(scene: Scene, patches: np.ndarray) -> np.ndarray:
    """Patch class ids (render.LABELS) -> [cameras, patches, 2] float32: the table (x, y)
    of the thing each patch shows (the arm's under the gripper's classes; a held movable is
    at the arm), NaN on the background. The target of the object-centric regression
    (train/losses.py object_loss): where the named object is, finer than its patch."""
    where = {label_of(t.colour, t.shape): (t.x, t.y) for t in scene.things}
    for arm in ("arm open", "arm closed"):
        where[LABELS.index(arm)] = (scene.arm.x, scene.arm.y)
    out = np.full((*patches.shape, 2), np.nan, np.float32)
    for label, xy in where.items():
        out[patches == label] = xy
    return out


def ground_labels(patches: np.ndarray, task: PutTask) -> np.ndarray:
    """Patch class ids (render.LABELS) -> GROUND ids: 1 the named movable, 2 the named
    container, 0 anything else (names are unique in a scene)."""
    movable, container = (label_of(*name.split(" ")) for name in (task.movable, task.container))
    return np.where(patches == movable, 1, np.where(patches == container, 2, 0))
