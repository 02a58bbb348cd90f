"""Forced-choice scene QA: of the answers a question's kind allows, the one the model
finds most likely (the sum of its tokens' and the EOS's log-probabilities after the
question, teacher-forced through the training forward, the same computation the engine's
prefill and decode make). The free-text accuracy of `eval world` asks the model to write
the answer word, and random weights never write one (they score 0, under chance); here
every row picks among the kind's candidates, so random weights score near chance
(`questions.CHANCE`) and the trained ones near their free-text accuracy: the check that
the eval separates a model that knows from one that guesses."""

from __future__ import annotations

import numpy as np
import torch

from embodied_kv.eval.items import EvalConfig, question_item
from embodied_kv.train.batch import IGNORE, make_batch
from embodied_kv.train.forward import backbone_forward, text_logits
from embodied_kv.world.dataset import DataConfig, Sample, scene_sample
from embodied_kv.world.expert import expert_action
from embodied_kv.world.questions import KINDS, WHERE_WORDS
from embodied_kv.world.vocab import COLOURS, number_word

CANDIDATES = {
    "colour": tuple(COLOURS),
    "left": ("yes", "no"),
    "count": tuple(number_word(n) for n in range(4)),  # questions.ask_count: zero .. three
    "where": WHERE_WORDS,
}


def candidate_samples(scene, task, question: str, kind: str, model) -> list[Sample]:
    """One `answer` sample per candidate of `kind`: the question as training asks it."""
    data = DataConfig(image_size=model.cfg.vision.image_size,
                      patch=model.cfg.vision.patch_size, horizon=model.cfg.action_horizon)
    _, phase = expert_action(scene, task)
    suffix = f"\nQuestion: {question}\nAnswer: "
    return [scene_sample(data, scene, task, "answer", ((suffix, c),), phase)
            for c in CANDIDATES[kind]]  # fmt: skip


@torch.no_grad()
def choose(model, samples: list[Sample]) -> int:
    """Index of the sample whose target (candidate + EOS) has the highest log-probability."""
    batch = make_batch(samples, model.tokenizer, model.cfg).to(model.device)
    out = backbone_forward(model, batch, 0)
    rows, cols = (batch.labels != IGNORE).nonzero(as_tuple=True)
    logp = text_logits(model, out, rows, cols).float().log_softmax(-1)
    token = logp.gather(1, batch.labels[rows, cols][:, None])[:, 0]
    score = torch.zeros(len(samples), device=token.device).index_add(0, rows, token)
    return int(score.argmax())


def choice_accuracy(model, cfg: EvalConfig) -> dict[str, float]:
    """Forced-choice accuracy over cfg.questions scene questions (eval world's items, in
    order), overall as `qa_choice` and per kind as `qa_choice_<kind>`."""
    right: dict[str, list[bool]] = {k: [] for k in KINDS}
    for i in range(cfg.questions):
        scene, task, qa = question_item(cfg, i)
        picked = choose(model, candidate_samples(scene, task, qa.question, qa.kind, model))
        right[qa.kind].append(CANDIDATES[qa.kind][picked] == qa.answer)
    every = [ok for v in right.values() for ok in v]
    out = {"qa_choice": float(np.mean(every)) if every else float("nan")}
    out |= {f"qa_choice_{k}": float(np.mean(v)) for k, v in right.items() if v}
    return out
