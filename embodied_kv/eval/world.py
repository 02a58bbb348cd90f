"""`embodied-kv eval world`: closed-loop task success, scene-question accuracy and one-
and two-hop memory-query accuracy on held-out world seeds, through the real engine.

The model acts through `Engine.cycle` (one prefill, the action expert, batched decode),
executing `replan_every` actions of each chunk, as the robot loop does. Rows in one run:
random weights (the floor), the given weights, and the scripted expert through the same
closed loop (the ceiling, which checks that the world and its success test agree)."""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embodied_kv.bench.report import device_name, print_table, write_json
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.kv.manager import TaskKind
from embodied_kv.model.vla import Observation, build_model
from embodied_kv.train.loop import EVAL_SEED_BASE
from embodied_kv.train.tokenizer import save_tokenizer
from embodied_kv.train.trained import TOKENIZER_FILE, load_trained, world_config
from embodied_kv.world import memory, questions
from embodied_kv.world.expert import expert_chunk
from embodied_kv.world.render import observation_images
from embodied_kv.world.scene import Scene, make_scene
from embodied_kv.world.tasks import PutTask, sample_task

SLOW_HZ = 1e-3  # a control period of minutes: every decode finishes within its cycle


@dataclass(frozen=True)
class EvalConfig:
    episodes: int = 50
    questions: int = 60  # scene questions (kinds in turn)
    memory: int = 60  # memory queries, half one-hop, half two-hop
    max_cycles: int = 12  # control cycles per episode (the expert needs <= 5)
    replan_every: int = 5  # actions executed per chunk (EngineConfig.replan_every)
    memory_updates: int = 1
    seed: int = EVAL_SEED_BASE  # held out: above every training seed (train/loop.py)

    def __post_init__(self):
        if min(self.episodes, self.questions, self.memory) < 0 or self.max_cycles < 1:
            raise ValueError(f"bad eval config: {self}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every={self.replan_every} must be >= 1")


def make_engine(model, cfg: EvalConfig) -> Engine:
    return Engine(
        EngineConfig(
            control_hz=SLOW_HZ, replan_every=cfg.replan_every, history=0,
            auto_episode_capsule=False, answer_tokens=8, cuda_graphs=False,
        ),
        model=model,
    )  # fmt: skip


def episode(scene_seed: int) -> tuple[Scene, PutTask]:
    rng = np.random.default_rng(scene_seed)
    scene = make_scene(rng)
    return scene, sample_task(scene, rng)


def observe(engine: Engine, scene: Scene, instruction: str) -> None:
    size = engine.model.cfg.vision.image_size
    images = torch.from_numpy(observation_images(scene, size))
    engine.observe(Observation(images, scene.state(), instruction))


def closed_loop(engine: Engine | None, cfg: EvalConfig) -> float:
    """Task success rate over cfg.episodes; engine None runs the scripted expert."""
    if cfg.episodes == 0:
        return float("nan")
    wins = 0
    for e in range(cfg.episodes):
        scene, task = episode(cfg.seed + e)
        if engine is not None:
            engine.begin_episode()
        for c in range(cfg.max_cycles):
            if engine is None:
                chunk = expert_chunk(scene, task, cfg.replan_every)
            else:
                observe(engine, scene, task.instruction)
                chunk = engine.cycle(c * cfg.replan_every).chunk
            for a in chunk[: cfg.replan_every]:
                scene.step(a)
            if task.success(scene):
                wins += 1
                break
    return wins / cfg.episodes


def answer(engine: Engine, scene: Scene, instruction: str, text: str, kind: TaskKind) -> str:
    """Ask through the engine on this scene's frame -> the finished text."""
    engine.begin_episode()
    observe(engine, scene, instruction)
    request_id, refused = engine.ask(text, kind)
    if refused is not None:
        raise ValueError(f"the engine refused an eval request: {refused.reason}")
    for _ in range(4):
        for ev in engine.cycle(0).events:
            if ev.request_id == request_id and ev.done:
                return ev.text.strip()
    raise RuntimeError("the engine did not finish an eval request in 4 cycles")


def question_accuracy(engine: Engine, cfg: EvalConfig) -> dict[str, float]:
    right = {k: [] for k in questions.KINDS}
    for i in range(cfg.questions):
        scene, task = episode(cfg.seed + 10**6 + i)
        rng = np.random.default_rng(cfg.seed + 2 * 10**6 + i)
        qa = questions.sample_question(scene, rng, questions.KINDS[i % len(questions.KINDS)])
        got = answer(engine, scene, task.instruction, qa.question, TaskKind.ANSWER)
        right[qa.kind].append(got == qa.answer)
    per_kind = {f"qa_{k}": float(np.mean(v)) for k, v in right.items() if v}
    all_ = [x for v in right.values() for x in v]
    return {"qa": float(np.mean(all_)) if all_ else float("nan"), **per_kind}


def memory_accuracy(engine: Engine, cfg: EvalConfig) -> dict[str, float]:
    right: dict[int, list[bool]] = {1: [], 2: []}
    for i in range(cfg.memory):
        scene, task = episode(cfg.seed + 3 * 10**6 + i)
        rng = np.random.default_rng(cfg.seed + 4 * 10**6 + i)
        mq = memory.sample_query(rng, 1 + i % 2, n_updates=cfg.memory_updates)
        got = answer(engine, scene, task.instruction, mq.prompt, TaskKind.PLAN)
        right[mq.hops].append(got == mq.answer)
    return {
        "one_hop": float(np.mean(right[1])) if right[1] else float("nan"),
        "two_hop": float(np.mean(right[2])) if right[2] else float("nan"),
    }


def evaluate(model, cfg: EvalConfig) -> dict[str, float]:
    engine = make_engine(model, cfg)
    t = time.perf_counter()
    row = {"success": closed_loop(engine, cfg)}
    row |= question_accuracy(engine, cfg)
    row |= memory_accuracy(engine, cfg)
    row["seconds"] = time.perf_counter() - t
    return row


def chance() -> dict[str, float]:
    """What guessing uniformly among an answer kind's candidates scores."""
    qa = [questions.CHANCE[k] for k in questions.KINDS]
    return {
        "qa": float(np.mean(qa)),
        **{f"qa_{k}": v for k, v in questions.CHANCE.items()},
        "one_hop": memory.CHANCE["one_hop"],
        "two_hop": memory.CHANCE["two_hop"],
    }


def run(weights: str, tokenizer: str, cfg: EvalConfig, oracle: bool = True) -> dict:
    """Every row of one eval run -> the result dict (what --json writes)."""
    rows: dict[str, dict] = {}
    trained = load_trained(weights, tokenizer or None) if weights else None
    mcfg = trained.cfg if trained is not None else world_config()
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)  # the same closed vocabulary
        rows["random"] = evaluate(build_model(mcfg, tokenizer_path=str(tok)), cfg)
    if trained is not None:
        rows["trained"] = evaluate(trained, cfg)
    if oracle:
        rows["expert"] = {"success": closed_loop(None, cfg)}
    return {
        "benchmark": "eval_world",
        "device": device_name("cpu"),
        "config": vars(cfg),
        "weights": weights or None,
        "chance": chance(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv eval world", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="", help="own-layout weights (train's output); "
                   "omitted: only the random floor and the expert")  # fmt: skip
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--episodes", type=int, default=EvalConfig.episodes)
    p.add_argument("--questions", type=int, default=EvalConfig.questions)
    p.add_argument("--memory", type=int, default=EvalConfig.memory)
    p.add_argument("--seed", type=int, default=EvalConfig.seed)
    p.add_argument("--no-oracle", action="store_true", help="skip the scripted-expert row")
    p.add_argument("--json", default="", help="write the result here (atomic)")
    a = p.parse_args(argv)
    cfg = EvalConfig(episodes=a.episodes, questions=a.questions, memory=a.memory, seed=a.seed)
    result = run(a.weights, a.tokenizer, cfg, oracle=not a.no_oracle)
    keys = ["success", "qa", *[f"qa_{k}" for k in questions.KINDS], "one_hop", "two_hop"]
    table = [["chance", "-", *[result["chance"].get(k, float("nan")) for k in keys[1:]]]]
    for name, row in result["rows"].items():
        table.append([name, *[row.get(k, float("nan")) for k in keys]])
    print_table(["weights", *keys], table)
    if a.json:
        write_json(result, a.json)
    return 0
