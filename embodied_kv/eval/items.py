"""The held-out items of `eval world` and how a runner (eval/runners.py) goes through
them: closed-loop episodes, scene questions, memory queries. Seeds lie above every
training seed (train/config.py EVAL_SEED_BASE); item i is a pure function of (cfg, i)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from embodied_kv.eval.runners import as_runner
from embodied_kv.kv.manager import TaskKind
from embodied_kv.train.config import EVAL_SEED_BASE
from embodied_kv.world import memory, questions
from embodied_kv.world.expert import STAGES, expert_action, expert_chunk
from embodied_kv.world.scene import Scene
from embodied_kv.world.tasks import PutTask, episode

ACTION_MODES = ("flow", "ar")


@dataclass(frozen=True)
class EvalConfig:
    episodes: int = 50
    questions: int = 60  # scene questions (kinds in turn)
    memory: int = 60  # memory queries, half one-hop, half two-hop
    max_cycles: int = 12  # control cycles per episode (the expert needs <= 5)
    replan_every: int = 5  # actions executed per chunk (EngineConfig.replan_every)
    memory_updates: int = 1
    seed: int = EVAL_SEED_BASE  # held out: above every training seed (train/config.py)
    action_mode: str = "flow"  # flow: the action expert | ar: bins action tokens (ActionFlow)
    sanity: int = 0  # episodes, questions and queries re-run for the exactness rows (0: none)
    # what the stage errors compare the first action with: the expert's action in the
    # labels the model learned (world/expert.py ACTION_LABELS; evaluate() sets the model's)
    labels: str = "targets"

    def __post_init__(self):
        if min(self.episodes, self.questions, self.memory, self.sanity) < 0:
            raise ValueError(f"counts must be >= 0: {self}")
        if self.max_cycles < 1 or self.replan_every < 1:
            raise ValueError(f"max_cycles={self.max_cycles}, replan_every={self.replan_every} "
                             "must be >= 1")  # fmt: skip
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode={self.action_mode!r}; use one of {ACTION_MODES}")


@dataclass
class Episode:
    success: bool
    chunks: list[np.ndarray]  # [H, A] each, as the runner returned them
    # per control cycle: (the task's stage there, xy distance of the chunk's first action
    # from the expert's action at that state), the per-stage errors of `eval world`
    errors: list[tuple[str, float]] = field(default_factory=list)
    stage: str = ""  # the stage where it ended ("done" on success, else where it was stuck)


def run_episode(runner, cfg: EvalConfig, index: int, start: int = 0, state=None) -> Episode:
    """Held-out episode `index` in closed loop (runner None: the scripted expert). `state`
    (scene, task) with `start` > 0 resumes one from that cycle (sanity.py's replay)."""
    scene, task = state or episode(cfg.seed + index)
    if runner is not None and start == 0:
        runner.begin()
    chunks, errors = [], []
    for c in range(start, cfg.max_cycles):
        if runner is None:
            chunk = expert_chunk(scene, task, cfg.replan_every)
        else:
            chunk = runner.act(scene, task.instruction, c)
        chunks.append(chunk)
        phase = expert_action(scene, task)[1]
        want = expert_chunk(scene, task, 1, cfg.labels)[0]
        errors.append((STAGES[phase], float(np.hypot(*(np.asarray(chunk[0][:2]) - want[:2])))))
        for a in chunk[: cfg.replan_every]:
            scene.step(a)
        if task.success(scene):
            return Episode(True, chunks, errors, "done")
    return Episode(False, chunks, errors, STAGES[expert_action(scene, task)[1]])


def closed_loop(runner, cfg: EvalConfig) -> float:
    """Task success rate over cfg.episodes; runner (or an Engine) None runs the scripted
    expert."""
    return closed_loop_stages(runner, cfg)["success"]


def closed_loop_stages(runner, cfg: EvalConfig) -> dict:
    """-> success (rate over cfg.episodes), err_<stage> (mean xy distance of the first
    action from the expert's over the cycles at that stage) and stuck_<stage> (failed
    episodes that ended there)."""
    if cfg.episodes == 0:
        return {"success": float("nan")}
    runner = as_runner(runner)
    eps = [run_episode(runner, cfg, e) for e in range(cfg.episodes)]
    out: dict = {"success": float(np.mean([e.success for e in eps]))}
    for stage in STAGE_ORDER:
        errs = [d for e in eps for s, d in e.errors if s == stage]
        if errs:
            out[f"err_{stage}"] = float(np.mean(errs))
    for stage in STAGE_ORDER:
        stuck = sum(not e.success and e.stage == stage for e in eps)
        if stuck:
            out[f"stuck_{stage}"] = stuck
    return out


STAGE_ORDER = ("approach", "grasp", "carry", "release")


def question_item(
    cfg: EvalConfig, i: int, kind: str | None = None
) -> tuple[Scene, PutTask, questions.QA]:
    """Scene question i: of the KINDS in turn, or of `kind` (e.g. "where", kept out of
    the QA figure) on the same scenes."""
    scene, task = episode(cfg.seed + 10**6 + i)
    rng = np.random.default_rng(cfg.seed + 2 * 10**6 + i)
    kind = kind or questions.KINDS[i % len(questions.KINDS)]
    return scene, task, questions.sample_question(scene, rng, kind)


def memory_item(cfg: EvalConfig, i: int) -> tuple[Scene, PutTask, memory.MemoryQuery]:
    scene, task = episode(cfg.seed + 3 * 10**6 + i)
    rng = np.random.default_rng(cfg.seed + 4 * 10**6 + i)
    return scene, task, memory.sample_query(rng, 1 + i % 2, n_updates=cfg.memory_updates)


def answer(runner, scene: Scene, instruction: str, text: str, kind: TaskKind) -> str:
    """Ask on this scene's frame of a fresh episode -> the finished text."""
    runner.begin()
    return runner.finish(runner.submit(scene, instruction, text, kind))
