"""`embodied-kv eval world`: closed-loop task success, scene-question accuracy and one-
and two-hop memory-query accuracy on held-out world seeds, through the real engine.

The model acts through `Engine.cycle` (one prefill, the action expert or ActionFlow's
action tokens, batched decode), executing `replan_every` actions of each chunk, as the
robot loop does. Rows in one run: random weights (the floor), the given weights, and the
scripted expert through the same closed loop (the ceiling, which checks that the world
and its success test agree). Sanity rows (eval/sanity.py) re-run part of the set through
the exact mechanisms: unified vs isolated, restored vs never interrupted."""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from embodied_kv.bench.report import device_name, print_table, write_json
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.loading import shipped_weights
from embodied_kv.eval import sanity
from embodied_kv.eval.choice import choice_accuracy
from embodied_kv.eval.items import (  # EvalConfig, closed_loop, episode: also imported from here
    ACTION_MODES,
    STAGE_ORDER,
    EvalConfig,
    answer,
    closed_loop,
    closed_loop_stages,
    episode,
    memory_item,
    question_item,
)
from embodied_kv.eval.runners import EngineRunner, as_runner
from embodied_kv.kv.manager import TaskKind
from embodied_kv.model.action_tokens import ActionTokenConfig
from embodied_kv.model.trained import TOKENIZER_FILE, load_trained, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.world import memory, questions
from embodied_kv.world.expert import labels_of

__all__ = ["EvalConfig", "accuracy_of", "closed_loop", "closed_loop_stages", "episode",
           "evaluate", "main", "make_engine", "memory_accuracy", "question_accuracy",
           "question_results", "run"]  # fmt: skip

SLOW_HZ = 1e-3  # a control period of minutes: every decode finishes within its cycle
AR_HORIZON = 10  # `ar`: bins tokens of 10 ticks x 8 dims (the world preset's 256 action ids)
LANGUAGE_SLOTS = 4  # arena slots beside the frame (flow) or ActionFlow's ring (ar)


def make_engine(model, cfg: EvalConfig) -> Engine:
    ar = ActionTokenConfig(kind="bins", horizon=AR_HORIZON)
    ring = AR_HORIZON * model.cfg.action_dim if cfg.action_mode == "ar" else 1  # ActionFlow K
    return Engine(
        EngineConfig(
            control_hz=SLOW_HZ, replan_every=cfg.replan_every, history=0,
            auto_episode_capsule=False, answer_tokens=8, cuda_graphs=False,
            action_mode=cfg.action_mode, ar=ar, num_slots=ring + LANGUAGE_SLOTS,
        ),
        model=model,
    )  # fmt: skip


def question_results(runner, cfg: EvalConfig) -> list[tuple[str, bool]]:
    """(kind, right) of each of cfg.questions scene questions, in item order (paired
    comparisons between runners: the same questions in the same order)."""
    runner = as_runner(runner)
    out = []
    for i in range(cfg.questions):
        scene, task, qa = question_item(cfg, i)
        got = answer(runner, scene, task.instruction, qa.question, TaskKind.ANSWER)
        out.append((qa.kind, got == qa.answer))
    return out


def where_accuracy(runner, cfg: EvalConfig) -> float:
    """Accuracy of "where is the X ?" (left / middle / right, chance 1/3) over a third of
    cfg.questions' scenes: name -> position, taught in training, not part of `qa`."""
    runner = as_runner(runner)
    right = []
    for i in range(cfg.questions // len(questions.KINDS)):
        scene, task, qa = question_item(cfg, i, "where")
        got = answer(runner, scene, task.instruction, qa.question, TaskKind.ANSWER)
        right.append(got == qa.answer)
    return float(np.mean(right)) if right else float("nan")


def question_accuracy(runner, cfg: EvalConfig) -> dict[str, float]:
    """Accuracy over cfg.questions scene questions, overall and per kind; `runner` may be
    an Engine."""
    return accuracy_of(question_results(runner, cfg))


def accuracy_of(results: list[tuple[str, bool]]) -> dict[str, float]:
    right = {k: [ok for kind, ok in results if kind == k] for k in questions.KINDS}
    per_kind = {f"qa_{k}": float(np.mean(v)) for k, v in right.items() if v}
    return {"qa": float(np.mean([ok for _, ok in results])) if results else float("nan"),
            **per_kind}  # fmt: skip


def memory_accuracy(runner, cfg: EvalConfig) -> dict[str, float]:
    """One- and two-hop accuracy over cfg.memory queries; `runner` may be an Engine."""
    runner = as_runner(runner)
    right: dict[int, list[bool]] = {1: [], 2: []}
    for i in range(cfg.memory):
        scene, task, mq = memory_item(cfg, i)
        got = answer(runner, scene, task.instruction, mq.prompt, TaskKind.PLAN)
        right[mq.hops].append(memory.names_place(got, mq.answer))
    return {
        "one_hop": float(np.mean(right[1])) if right[1] else float("nan"),
        "two_hop": float(np.mean(right[2])) if right[2] else float("nan"),
    }


def evaluate(model, cfg: EvalConfig) -> dict:
    cfg = replace(cfg, labels=labels_of(model.cfg.name))
    engine = make_engine(model, cfg)
    runner = EngineRunner(engine)
    t = time.perf_counter()
    row: dict = closed_loop_stages(runner, cfg)
    row |= question_accuracy(runner, cfg)
    row |= choice_accuracy(model, cfg)  # forced choice: random weights near chance
    row["where"] = where_accuracy(runner, cfg)
    row |= memory_accuracy(runner, cfg)
    row["seconds"] = time.perf_counter() - t
    if engine.action_tokens is not None:  # ar: chunks whose ids did not decode (zeros)
        counters = engine.action_tokens.counters
        row["ar_chunks"], row["ar_invalid"] = counters.decoded, counters.invalid
    if cfg.sanity:
        row["sanity"] = sanity.rows(engine, cfg)
    return row


def chance() -> dict[str, float]:
    """What guessing uniformly among an answer kind's candidates scores."""
    qa = float(np.mean([questions.CHANCE[k] for k in questions.KINDS]))
    return {
        "qa": qa,
        **{f"qa_{k}": questions.CHANCE[k] for k in questions.KINDS},
        "qa_choice": qa,  # a forced choice among a kind's answers: the same guess
        "one_hop": memory.CHANCE["one_hop"],
        "two_hop": memory.CHANCE["two_hop"],
        "where": questions.CHANCE["where"],
    }


def random_model(cfg_like):
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)  # the same closed vocabulary
        return build_model(cfg_like, tokenizer_path=str(tok))


def run(weights: str, tokenizer: str, cfg: EvalConfig, oracle: bool = True) -> dict:
    """Every row of one eval run -> the result dict (what --json writes)."""
    rows: dict[str, dict] = {}
    trained = load_trained(weights, tokenizer or None) if weights else None
    mcfg = trained.cfg if trained is not None else world_config()
    rows["random"] = evaluate(random_model(mcfg), cfg)
    if trained is not None:
        rows["trained"] = evaluate(trained, cfg)
    if oracle:
        rows["expert"] = closed_loop_stages(None, cfg)
    return {
        "benchmark": "eval_world",
        "device": device_name("cpu"),
        "config": asdict(cfg),
        "weights": weights or None,
        "chance": chance(),
        "rows": rows,
    }


def print_stages(rows: dict) -> None:
    """Per row: the first action's xy error per task stage, and where failed episodes
    were stuck."""
    for name, row in rows.items():
        errs = [f"{s} {row[f'err_{s}']:.3f}" for s in STAGE_ORDER if f"err_{s}" in row]
        stuck = [f"{s} {row[f'stuck_{s}']}" for s in STAGE_ORDER if f"stuck_{s}" in row]
        if errs or stuck:
            print(f"{name}: first-action xy error by stage: {', '.join(errs) or '-'}; "
                  f"failed episodes stuck at: {', '.join(stuck) or 'none'}")


def default_weights() -> str:
    path = shipped_weights("world")
    return str(path) if path else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="embodied-kv eval world", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=None, help="own-layout weights (train's output); "
                   "default: the shipped embodied_kv/data/world/ when installed; '' = only "
                   "the random floor and the expert")  # fmt: skip
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--episodes", type=int, default=EvalConfig.episodes)
    p.add_argument("--questions", type=int, default=EvalConfig.questions)
    p.add_argument("--memory", type=int, default=EvalConfig.memory)
    p.add_argument("--seed", type=int, default=EvalConfig.seed)
    p.add_argument("--action-mode", default="flow", choices=ACTION_MODES,
                   help=f"ar: bins action tokens, horizon {AR_HORIZON}, pipelined (ActionFlow)")
    p.add_argument("--sanity", type=int, default=10, help="episodes / questions / queries "
                   "re-run unified vs isolated and restored vs never interrupted (0: skip)")
    p.add_argument("--no-oracle", action="store_true", help="skip the scripted-expert row")
    p.add_argument("--json", default="", help="write the result here (atomic)")
    a = p.parse_args(argv)
    cfg = EvalConfig(
        episodes=a.episodes, questions=a.questions, memory=a.memory, seed=a.seed,
        action_mode=a.action_mode, sanity=a.sanity,
    )  # fmt: skip
    weights = default_weights() if a.weights is None else a.weights
    result = run(weights, a.tokenizer, cfg, oracle=not a.no_oracle)
    print(f"eval world: {cfg.action_mode} actions; weights {weights or 'none (random only)'}")
    keys = ["success", "qa", *[f"qa_{k}" for k in questions.KINDS], "qa_choice", "one_hop",
            "two_hop", "where"]  # fmt: skip
    table = [["chance", "-", *[result["chance"].get(k, float("nan")) for k in keys[1:]]]]
    for name, row in result["rows"].items():
        table.append([name, *[row.get(k, float("nan")) for k in keys]])
    print_table(["weights", *keys], table)
    for name, row in result["rows"].items():
        if "ar_chunks" in row:
            print(f"ar {name}: {row['ar_invalid']} of {row['ar_chunks']} action-token chunks "
                  "invalid (decoded as zeros)")  # fmt: skip
    print_stages(result["rows"])
    sanity.print_rows(result["rows"])
    if a.json:
        write_json(result, a.json)
    return 0
