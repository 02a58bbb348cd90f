"""Behaviour rows for the exact mechanisms (`eval world --sanity N`): the first N
held-out episodes, scene questions and memory queries run again through

* `unified_vs_isolated` (flow): OxyGen's shared prefill + batched decode (Engine.cycle)
  against the isolated baseline (engine/isolated.py: every task on its own prefill);
* `unified_vs_separate` (ar): language decodes in ActionFlow's packed step against a
  decode step of their own (`ar.unified: false`);
* `restore_vs_never`: each episode snapshotted after its first cycle, run to its end
  (never interrupted), another episode run over every live buffer, the capsule restored
  and the rest replayed from the saved scene; each question snapshotted with its request
  waiting, answered, another question answered, restored and answered again.

They are byte-exact by construction (the engine's tests compare bytes and token ids),
so these rows are a sanity check on behaviour, not a new claim: the same success, the
same answers, every action chunk equal in bytes."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from embodied_kv.engine.engine import Engine
from embodied_kv.eval.items import Episode, answer, episode, memory_item, question_item, run_episode
from embodied_kv.eval.runners import EngineRunner, IsolatedEval
from embodied_kv.kv.manager import TaskKind

CAPSULE = "eval-sanity"
MID_CYCLE = 1  # snapshot after this many cycles: every pick-and-place needs more


def rows(engine, cfg) -> dict[str, dict]:
    out = {}
    if engine.action_tokens is None:
        out["unified_vs_isolated"] = compare(EngineRunner(engine), IsolatedEval(engine), cfg)
    else:  # ar: language in the pipeline's packed step vs a step of its own
        separate = Engine(replace(engine.cfg, ar_unified=False), model=engine.model)
        out["unified_vs_separate"] = compare(EngineRunner(engine), EngineRunner(separate), cfg)
    out["restore_vs_never"] = restore_vs_never(engine, cfg)
    return out


def _texts(cfg) -> list[tuple]:
    """(scene, instruction, prompt text, kind, truth) of the first `sanity` questions and
    memory queries."""
    items = []
    for i in range(min(cfg.sanity, cfg.questions)):
        scene, task, qa = question_item(cfg, i)
        items.append((scene, task.instruction, qa.question, TaskKind.ANSWER, qa.answer))
    for i in range(min(cfg.sanity, cfg.memory)):
        scene, task, mq = memory_item(cfg, i)
        items.append((scene, task.instruction, mq.prompt, TaskKind.PLAN, mq.answer))
    return items


def _row(a_eps, b_eps, a_txt, b_txt, truth) -> dict:
    pairs = [(x, y) for ea, eb in zip(a_eps, b_eps, strict=True)
             for x, y in zip(ea.chunks, eb.chunks, strict=False)]  # fmt: skip
    equal = sum(_bytes(x) == _bytes(y) for x, y in pairs)
    n_chunks = sum(max(len(ea.chunks), len(eb.chunks)) for ea, eb in zip(a_eps, b_eps, strict=True))
    same_answers = sum(x == y for x, y in zip(a_txt, b_txt, strict=True))
    row = {
        "episodes": len(a_eps),
        "success": [_mean([e.success for e in a_eps]), _mean([e.success for e in b_eps])],
        "answers": len(a_txt),
        "accuracy": [_mean([x == t for x, t in zip(a_txt, truth, strict=True)]),
                     _mean([y == t for y, t in zip(b_txt, truth, strict=True)])],  # fmt: skip
        "chunks_equal": equal,
        "chunks": n_chunks,
        "answers_equal": same_answers,
    }
    row["exact"] = equal == n_chunks and same_answers == len(a_txt) and all(
        ea.success == eb.success for ea, eb in zip(a_eps, b_eps, strict=True)
    )
    return row


def _bytes(chunk: np.ndarray) -> tuple:
    return chunk.dtype.str, chunk.shape, chunk.tobytes()


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def compare(a, b, cfg) -> dict:
    """The same episodes, questions and queries through two runners."""
    n = min(cfg.sanity, cfg.episodes)
    items = _texts(cfg)
    eps = [[run_episode(r, cfg, e) for e in range(n)] for r in (a, b)]
    texts = [[answer(r, s, ins, text, kind) for s, ins, text, kind, _ in items] for r in (a, b)]
    return _row(*eps, *texts, [t for *_, t in items])


def restore_vs_never(engine, cfg) -> dict:
    runner = EngineRunner(engine)
    never, restored = [], []
    for e in range(min(cfg.sanity, cfg.episodes)):
        scene, task = episode(cfg.seed + e)
        head = run_episode(runner, replace(cfg, max_cycles=MID_CYCLE), e, state=(scene, task))
        engine.snapshot(CAPSULE, "host")
        saved = scene.copy()
        tail = run_episode(runner, cfg, e, start=MID_CYCLE, state=(scene, task))
        never.append(Episode(tail.success, head.chunks + tail.chunks))
        run_episode(runner, cfg, e + 10**5)  # another episode over every live buffer
        engine.restore(CAPSULE)
        again = run_episode(runner, cfg, e, start=MID_CYCLE, state=(saved, task))
        restored.append(Episode(again.success, head.chunks + again.chunks))
        engine.store.delete(CAPSULE)
    items = _texts(cfg)
    first, second = [], []
    for scene, instruction, text, kind, _ in items:
        runner.begin()
        request_id = runner.submit(scene, instruction, text, kind)
        engine.snapshot(CAPSULE, "host")  # the request waits in the policy's queue
        first.append(runner.finish(request_id))
        other_scene, other_ins, other_text, other_kind, _ = items[(len(first)) % len(items)]
        runner.begin()
        runner.finish(runner.submit(other_scene, other_ins, other_text, other_kind))
        engine.restore(CAPSULE)
        # the request ended above, so the restore drops it (one final event per id,
        # docs/requests.md): the same question asked again in the restored state
        second.append(runner.finish(runner.submit(scene, instruction, text, kind)))
        engine.store.delete(CAPSULE)
    return _row(never, restored, first, second, [t for *_, t in items])


def print_rows(result_rows: dict[str, dict]) -> None:
    for weights, row in result_rows.items():
        for name, s in row.get("sanity", {}).items():
            a, b = name.split("_vs_")
            print(
                f"sanity {weights} {a} vs {b}: success {s['success'][0]:.2f} / "
                f"{s['success'][1]:.2f} over {s['episodes']} episodes, chunks byte-equal "
                f"{s['chunks_equal']}/{s['chunks']}, answers equal {s['answers_equal']}/"
                f"{s['answers']} (accuracy {s['accuracy'][0]:.2f} / {s['accuracy'][1]:.2f})"
                f" -> {'same' if s['exact'] else 'DIFFERENT'}"
            )
