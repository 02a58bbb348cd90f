"""The object-centric regression (`embodied-kv train --object-weight`, issue 34): every
patch that shows a thing is labelled with that thing's table (x, y) — the arm's under the
gripper, a held movable at the arm — the background with NaN; the loss is the MSE over
the labelled patches only; the patch head grows two outputs after the position pair, the
grounding head two after its classes (the same target from deeper rows)."""

import json

import numpy as np
import pytest
import torch

from embodied_kv.train.batch import make_batch
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.grounding import GroundHead, object_loss
from embodied_kv.train.loop import train
from embodied_kv.train.losses import head_outputs
from embodied_kv.world.dataset import DataConfig, make_sample, object_centres
from embodied_kv.world.render import LABELS, label_of, patch_labels
from embodied_kv.world.tasks import episode

DATA = DataConfig(rollout="task", first_share=0.3, arm_start_share=0.5, text_mix=(1, 1, 1, 1))


def test_each_patch_gets_the_centre_of_the_thing_it_shows():
    scene, _ = episode(5)
    patches = patch_labels(scene, 64, 8)
    centres = object_centres(scene, patches)
    assert centres.shape == (2, 64, 2) and centres.dtype == np.float32
    assert np.isnan(centres[patches == 0]).all() and np.isfinite(centres[patches != 0]).all()
    for t in scene.things:
        shown = patches == label_of(t.colour, t.shape)
        assert shown[0].any()  # every thing shows in the top camera at 64 px
        np.testing.assert_allclose(centres[shown], np.float32([t.x, t.y])[None].repeat(
            int(shown.sum()), 0))  # fmt: skip
    arm = (patches == 1) | (patches == 2)
    assert arm.any()
    np.testing.assert_allclose(centres[arm][:, 0], scene.arm.x)
    np.testing.assert_allclose(centres[arm][:, 1], scene.arm.y)


def test_a_held_movable_is_where_the_arm_is():
    scene, task = episode(5)
    m = scene.get(task.movable)
    scene.arm.x, scene.arm.y, scene.arm.z = m.x, m.y, -1.0
    scene.step(np.array([m.x, m.y, -1.0, 1.0]))  # close low over it: attached
    assert scene.arm.holding == task.movable
    scene.step(np.array([0.3, 0.1, 1.0, 1.0]))  # carry it away
    patches = patch_labels(scene, 64, 8)
    shown = patches == label_of(*task.movable.split(" "))
    assert shown.any()
    np.testing.assert_allclose(object_centres(scene, patches)[shown],
                               np.float32([[scene.arm.x, scene.arm.y]] * int(shown.sum())))


def test_the_loss_counts_only_the_patches_that_show_a_thing():
    pred = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [5.0, -5.0]]])
    centres = torch.tensor([[[1.0, 0.0], [float("nan")] * 2, [5.0, -3.0]]])
    assert float(object_loss(pred, centres)) == pytest.approx((1 + 0 + 0 + 4) / 4)
    none = torch.full((1, 3, 2), float("nan"))
    zero = object_loss(pred.requires_grad_(), none)
    assert float(zero.detach()) == 0 and zero.requires_grad
    with pytest.raises(ValueError, match="centres"):
        object_loss(pred, None)


def test_the_grounding_head_regresses_the_centres_from_its_rows():
    head = GroundHead(width=8, layer=2, centres=True)
    rows = torch.randn(1, 3, 8)
    labels = torch.tensor([[0, 1, 2]])
    centres = torch.tensor([[[float("nan")] * 2, [0.5, -0.25], [-0.5, 0.75]]])
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.5, 0.75]))  # (0.5, 0.75) everywhere
    _, _, obj = head.loss(rows, labels, centres)
    assert float(obj.detach()) == pytest.approx((0 + 1 + 1 + 0) / 4)
    with pytest.raises(ValueError, match="centres"):
        head.loss(rows, labels)


def test_the_batch_carries_the_centres_in_token_order(tmp_path):
    from embodied_kv.model.trained import world_config
    from embodied_kv.model.vla import build_model
    from embodied_kv.model.word_tokenizer import save_tokenizer

    tok = save_tokenizer(tmp_path / "tokenizer.json")
    model = build_model(world_config(), "cpu", tokenizer_path=str(tok))
    samples = [make_sample(DATA, seed) for seed in range(3)]
    batch = make_batch(samples, model.tokenizer, model.cfg)
    assert batch.centres.shape == (3, 128, 2)
    for b, s in enumerate(samples):
        np.testing.assert_array_equal(batch.centres[b].numpy(), s.centres.reshape(-1, 2))


def test_a_run_learns_the_centres_beside_the_position(tmp_path):
    assert head_outputs(False, False) == len(LABELS)
    assert head_outputs(True, True) == len(LABELS) + 4
    recipe = dict(batch=3, curriculum=0, warmup=1, log_every=1, ckpt_every=100, flow_dims=4,
                  data=DATA, position_weight=1.0, object_weight=1.0,
                  ground_weight=1.0)  # fmt: skip
    out = tmp_path / "run"
    log = train(TrainConfig(out=str(out), steps=2, until=1, **recipe), progress=False)
    log += train(TrainConfig(out=str(out), steps=2, resume=True, **recipe), progress=False)
    assert [r["step"] for r in log] == [0, 1]
    assert all(r["object"] > 0 and r["object_rows"] > 0 and r["position"] > 0 for r in log)
    saved = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["object"] for r in saved] == [r["object"] for r in log]
    with pytest.raises(ValueError, match="object_weight"):
        TrainConfig(steps=1, object_weight=1.0, patch_weight=0.0)


def test_the_command_line_reaches_the_config():
    from embodied_kv.cli import build_parser, train_config

    args = build_parser().parse_args(["train", "--steps", "1", "--object-weight", "0.5"])
    assert train_config(args).object_weight == 0.5
