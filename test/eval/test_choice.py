"""Forced-choice scene QA (eval/choice.py): every answer the question generator gives is
a candidate, random weights score near chance and the shipped weights near their
free-text accuracy, through `eval world`'s own items."""

import numpy as np

from embodied_kv.engine.loading import shipped_weights
from embodied_kv.eval.choice import CANDIDATES, choice_accuracy
from embodied_kv.eval.items import EvalConfig, question_item
from embodied_kv.eval.world import random_model
from embodied_kv.model.trained import load_trained
from embodied_kv.world.questions import CHANCE, KINDS, TRAIN_KINDS


def test_every_generated_answer_is_a_candidate():
    cfg = EvalConfig(questions=300)
    for kind in TRAIN_KINDS:
        for i in range(0, 300, 3):
            _, _, qa = question_item(cfg, i, kind)
            assert qa.answer in CANDIDATES[qa.kind], (kind, qa)
        assert abs(1 / len(CANDIDATES[kind]) - CHANCE[kind]) < 1e-9


def test_random_weights_sit_near_chance_and_trained_weights_far_above():
    trained = load_trained(shipped_weights("world"))
    cfg = EvalConfig(questions=60)
    got = choice_accuracy(random_model(trained.cfg), cfg)
    chance = float(np.mean([CHANCE[k] for k in KINDS]))  # 0.333
    assert abs(got["qa_choice"] - chance) < 0.2, got  # 60 questions: SE ~0.06
    assert all(f"qa_choice_{k}" in got for k in KINDS)
    mine = choice_accuracy(trained, cfg)
    assert mine["qa_choice"] >= 0.85, mine  # measured 0.933 on these 60 (free text 0.933)
