"""Frozen parts (`embodied-kv train --freeze`): with vision and backbone frozen (pi0.5's
knowledge insulation) only the action expert learns, the rest keeps its bytes (so every
text skill stays), and the prefix-only backbone pass gives the expert exactly what the
full pass gives it; with the backbone frozen the vision tower learns through it, and the
position regression's targets are each patch's column and row."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from embodied_kv.model.trained import WEIGHTS_FILE, load_trained
from embodied_kv.model.weights import SHAPE_FREE, load_weights
from embodied_kv.train.batch import make_batch
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.forward import backbone_forward, expert_velocity
from embodied_kv.train.loop import model_data, train
from embodied_kv.train.losses import position_targets, prefix_only
from embodied_kv.world.dataset import DataConfig, make_sample

DATA = DataConfig(rollout="task", first_share=0.3, arm_start_share=0.5, text_mix=(1, 1, 1, 1))
RECIPE = dict(batch=3, curriculum=0, warmup=1, log_every=1, ckpt_every=100, flow_dims=4,
              freeze=("vision", "backbone"), data=DATA)  # fmt: skip


def test_only_the_expert_learns_and_the_run_resumes(tmp_path):
    base = tmp_path / "base"
    train(TrainConfig(out=str(base), steps=1, batch=3, curriculum=0, data=DATA), progress=False)
    init = str(base / WEIGHTS_FILE)
    one, cut = tmp_path / "one", tmp_path / "cut"
    train(TrainConfig(out=str(one), steps=3, init=init, **RECIPE), progress=False)
    train(TrainConfig(out=str(cut), steps=3, init=init, until=1, **RECIPE), progress=False)
    train(TrainConfig(out=str(cut), steps=3, init=init, resume=True, **RECIPE), progress=False)
    before, after = load_file(init), load_file(one / WEIGHTS_FILE)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith("expert.") for k in moved)
    frozen = [k for k in before if not k.startswith("expert.")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    resumed = load_file(cut / WEIGHTS_FILE)
    assert all(torch.equal(after[k], resumed[k]) for k in after)
    log = [json.loads(x) for x in (one / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2]
    assert all(r["text"] == 0 and r["flow"] > 0 and r["stage_err"] for r in log)
    assert all(r["patch"] == 0 and r["ground"] == 0 for r in log)  # the heads are off


def test_the_prefix_pass_gives_the_expert_what_the_full_pass_gives(tmp_path):
    base = tmp_path / "base"
    train(TrainConfig(out=str(base), steps=1, batch=3, curriculum=0, data=DATA), progress=False)
    model = load_trained(base / WEIGHTS_FILE)
    samples = [make_sample(DATA, seed) for seed in range(6)]
    assert {s.kind for s in samples} - {"narration"}  # text turns the prefix pass drops
    batch = make_batch(samples, model.tokenizer, model.cfg)
    cut = prefix_only(batch)
    assert cut.ids.shape[1] == int(batch.prompt_len.max()) < batch.ids.shape[1]
    x_t = torch.randn(batch.actions.shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.2, 0.5, 0.9, 0.3, 0.7, 1.0])
    with torch.no_grad():
        full = expert_velocity(model, backbone_forward(model, batch), x_t, t)
        short = expert_velocity(model, backbone_forward(model, cut), x_t, t)
    torch.testing.assert_close(short, full, atol=1e-5, rtol=1e-5)


def test_a_frozen_backbone_still_passes_gradients_to_the_vision_tower(tmp_path):
    base = tmp_path / "base"
    train(TrainConfig(out=str(base), steps=1, batch=3, curriculum=0, data=DATA), progress=False)
    init = str(base / WEIGHTS_FILE)
    recipe = {**RECIPE, "freeze": ("backbone",), "position_weight": 1.0, "ground_weight": 1.0}
    log = train(TrainConfig(out=str(tmp_path / "run"), steps=2, init=init, **recipe),
                progress=False)  # fmt: skip
    before, after = load_file(init), load_file(tmp_path / "run" / WEIGHTS_FILE)
    moved = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    assert moved == {"vision", "expert"}
    assert all(r["position"] > 0 and r["text"] > 0 and r["ground"] > 0 for r in log)
    with pytest.raises(ValueError, match="not all"):
        TrainConfig(steps=1, freeze=("vision", "backbone", "expert"))
    with pytest.raises(ValueError, match="some of"):
        TrainConfig(steps=1, freeze=("lm",))


def test_position_targets_are_each_patch_s_column_and_row():
    t = position_targets(cameras=2, image_tokens=2 * 9)
    assert t.shape == (1, 18, 2)
    assert t[0, :3].tolist() == [[-1, -1], [0, -1], [1, -1]]  # row 0: columns 0, 1, 2
    assert t[0, 8].tolist() == [1, 1] and torch.equal(t[0, 9:], t[0, :9])  # camera 2 again
    with pytest.raises(ValueError, match="square"):
        position_targets(cameras=2, image_tokens=2 * 8)


def test_the_command_line_reaches_the_config(tmp_path):
    from embodied_kv.cli import build_parser, train_config

    args = build_parser().parse_args(
        ["train", "--steps", "1", "--freeze", "vision,backbone", "--position-weight", "0.5",
         "--visited", str(tmp_path / "v.json"), "--visited-share", "0.25"]
    )  # fmt: skip
    cfg = train_config(args)
    assert cfg.freeze == ("vision", "backbone") and cfg.position_weight == 0.5
    assert cfg.data.visited == str(tmp_path / "v.json") and cfg.data.visited_share == 0.25


def test_world_smooth_learns_waypoints_from_the_world_s_weights(tmp_path):
    """`--preset world_smooth --init <world weights>`: the same parameters with a 30-action
    chunk; only the expert moves, on the waypoint labels; a world file loads into a
    world_smooth model only where the fine-tune allows the chunk to differ."""
    base = tmp_path / "base"
    train(TrainConfig(out=str(base), steps=1, batch=3, curriculum=0, data=DATA), progress=False)
    init = str(base / WEIGHTS_FILE)
    out = tmp_path / "smooth"
    train(TrainConfig(out=str(out), preset="world_smooth", steps=2, init=init, **RECIPE),
          progress=False)  # fmt: skip
    model = load_trained(out / WEIGHTS_FILE)
    assert (model.cfg.name, model.cfg.action_horizon) == ("world_smooth", 30)
    before, after = load_file(init), load_file(out / WEIGHTS_FILE)
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith("expert.") for k in moved)
    data = model_data(DATA, model.cfg)  # what the run's samples were made with
    assert (data.labels, data.horizon) == ("waypoints", 30)
    sample = make_sample(data, 5)
    assert sample.actions.shape == (30, 8)
    assert np.abs(np.diff(sample.actions[:, 2])).max() <= 0.5 + 1e-9  # z within a step
    with pytest.raises(ValueError, match="another model config"):
        load_weights(model, init)  # a different chunk is allowed only when asked for
    load_weights(model, init, SHAPE_FREE)
    with pytest.raises(ValueError, match="only fields"):
        load_weights(model, init, ("expert",))
