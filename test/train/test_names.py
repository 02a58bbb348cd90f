"""The position of each thing the text names (the instruction's movable and container, a
scene question's things), regressed from its name's row (train/names.py): the data carry
the names, the batch finds their rows, the loss reads the grounding head's object outputs
there, and a run logs it."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embodied_kv.model.prompt import WordTokenizer
from embodied_kv.model.trained import world_config
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import make_batch
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.grounding import GroundHead
from embodied_kv.train.loop import train
from embodied_kv.train.names import name_loss
from embodied_kv.world.dataset import GROUND, DataConfig, make_sample
from embodied_kv.world.questions import ask_colour, ask_count, ask_left, ask_where
from embodied_kv.world.scene import make_scene

ANSWERS = DataConfig(text_mix=(1.0, 0.0, 0.0, 0.0), turns=6, where_share=0.3)


def test_questions_name_their_things_in_order_with_their_positions():
    rng = np.random.default_rng(3)
    for _ in range(20):
        scene = make_scene(rng)
        by_name = {t.name: t for t in scene.things}
        qa = ask_left(scene, rng)
        if qa is not None:
            a, b = qa.named
            assert qa.question == f"is the {a[0]} left of the {b[0]} ?"
            assert (qa.answer == "yes") == (a[1] < b[1])
            for name, x, y in qa.named:
                assert (by_name[name].x, by_name[name].y) == (x, y)
        qa = ask_where(scene, rng)
        if qa is not None:
            ((name, x, y),) = qa.named
            assert name in qa.question and (by_name[name].x, by_name[name].y) == (x, y)
        qa = ask_colour(scene, rng)
        if qa is not None:
            ((shape, x, y),) = qa.named
            (thing,) = [t for t in scene.things if t.shape == shape]
            assert (thing.x, thing.y) == (x, y) and qa.answer == thing.colour
        assert ask_count(scene, rng).named == ()


def test_the_batch_points_at_each_names_last_token(tmp_path):
    tok = WordTokenizer(save_tokenizer(tmp_path / "tok.json"))
    samples = [make_sample(ANSWERS, s) for s in range(6)]
    b = make_batch(samples, tok, world_config())
    want = [(i, *name) for i, s in enumerate(samples) for name in s.names]
    assert len(want) > 10 + 2 * len(samples) and b.names_at.shape == (len(want), 2)
    np.testing.assert_allclose(b.names_xy.numpy(), [(x, y) for *_, x, y in want], rtol=1e-6)
    for (row, at), (i, turn, name, _, _) in zip(b.names_at.tolist(), want, strict=True):
        assert row == i
        words = tok.encode(name, bos=False)
        assert b.ids[row, at - len(words) + 1 : at + 1].tolist() == words
        # the instruction's names in the prompt, a question's after it
        assert (at < int(b.prompt_len[row])) == (turn < 0)
    for s in samples:  # the instruction names its movable, then its container, where they are
        task, scene_names = s.instruction.split("put the ")[1].split(" in the "), s.names[:2]
        assert [(i, n) for i, n, _, _ in scene_names] == [(-1, task[0]), (-1, task[1])]
    plans = [make_sample(DataConfig(text_mix=(0.0, 1.0, 0.0, 0.0)), s) for s in range(2)]
    assert make_batch(plans, tok, world_config()).names_at.shape == (4, 2)


def test_the_loss_is_the_object_outputs_mse_at_the_name_rows():
    torch.manual_seed(0)
    head = GroundHead(16, 2, centres=True)
    rows = torch.randn(3, 7, 16)
    at = torch.tensor([[0, 2], [2, 6], [2, 1]])
    xy = torch.tensor([[0.1, -0.2], [0.5, 0.3], [-0.7, 0.0]])
    want = F.mse_loss(head(rows)[at[:, 0], at[:, 1], len(GROUND) :], xy)
    torch.testing.assert_close(name_loss(head, rows, at, xy), want)
    assert float(name_loss(head, rows, at[:0], xy[:0])) == 0.0
    with pytest.raises(ValueError, match="object_weight"):
        name_loss(GroundHead(16, 2), rows, at, xy)


def test_a_run_logs_the_name_loss_and_the_flag_reaches_it(tmp_path):
    from embodied_kv.cli import build_parser, train_config

    data = DataConfig(text_mix=(0.8, 0.2, 0.0, 0.0), turns=2, memory_objects=3,
                      memory_updates=2)  # fmt: skip
    recipe = dict(batch=4, curriculum=0, warmup=1, log_every=1, ckpt_every=100, data=data,
                  ground_weight=1.0, object_weight=1.0, name_weight=1.0)  # fmt: skip
    log = train(TrainConfig(out=str(tmp_path / "a"), steps=2, **recipe), progress=False)
    assert all(r["names"] > 0 for r in log)
    saved = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["names"] for r in saved] == [r["names"] for r in log]
    args = build_parser().parse_args(["train", "--steps", "1", "--name-weight", "0.5",
                                      "--ground-weight", "1", "--object-weight", "1"])
    assert train_config(args).name_weight == 0.5
    with pytest.raises(ValueError, match="name_weight"):
        TrainConfig(steps=1, name_weight=1.0, ground_weight=1.0)  # no object outputs
