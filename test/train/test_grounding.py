"""Issue 34's training recipe: the grounding head lives in the training state only, the
flow loss can cover the real action dims only, and the log shows per-stage errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from embodied_kv.model.trained import WEIGHTS_FILE, load_trained
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.grounding import GroundHead
from embodied_kv.train.loop import train
from embodied_kv.train.losses import stage_errors
from embodied_kv.train.resume import STATE_FILE
from embodied_kv.world.dataset import DataConfig

RECIPE = dict(steps=4, batch=3, curriculum=0, warmup=2, log_every=1, ckpt_every=100,
              flow_dims=4, ground_weight=1.0,
              data=DataConfig(rollout="task", first_share=0.3, arm_start_share=0.5,
                              where_share=0.5))  # fmt: skip


def test_the_grounding_head_stays_out_of_the_weights_and_resumes(tmp_path):
    train(TrainConfig(out=str(tmp_path / "one"), **RECIPE), progress=False)
    cut = tmp_path / "cut"
    train(TrainConfig(out=str(cut), until=2, **RECIPE), progress=False)
    train(TrainConfig(out=str(cut), resume=True, **RECIPE), progress=False)
    a, b = load_file(tmp_path / "one" / WEIGHTS_FILE), load_file(cut / WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("ground" in k or k.startswith("head.") for k in a)
    state = load_file(cut / STATE_FILE)
    ground = {k for k in state if k.startswith("ground.")}
    assert ground == {"ground.proj.weight", "ground.proj.bias"}
    assert torch.equal(state["ground.proj.weight"],
                       load_file(tmp_path / "one" / STATE_FILE)["ground.proj.weight"])
    model = load_trained(cut / WEIGHTS_FILE)  # the engine's loader: no head, no leftovers
    assert set(model.state_dict()) >= {k for k in a}
    log = [json.loads(x) for x in (cut / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    assert all(r["ground"] > 0 and set(r["stage_err"]) <= {"approach", "grasp", "carry",
                                                             "release"} for r in log)  # fmt: skip
    assert all(r["flow"] == pytest.approx(r["flow_real"]) for r in log)  # flow_dims=4


def test_flow_over_all_dims_is_diluted_by_the_zero_dims(tmp_path):
    log = train(TrainConfig(out=str(tmp_path), steps=2, batch=3, curriculum=0),
                progress=False)  # fmt: skip
    # the same loss as before issue 34 (every dim); the real dims' share is logged beside
    assert all(r["flow"] != pytest.approx(r["flow_real"]) for r in log)
    assert all(r["ground"] == 0 for r in log)
    with pytest.raises(ValueError, match="ground_layer"):
        TrainConfig(steps=1, ground_layer=0)


def test_stage_errors_measure_the_first_action_s_xy():
    actions = torch.zeros(3, 10, 8)
    estimate = actions.clone()
    estimate[0, 0, :2] = torch.tensor([0.3, 0.4])  # 0.5 off in xy
    estimate[1, 0, 2:] = 5.0  # z and gripper do not count
    estimate[2, 1, :2] = 9.0  # nor later actions
    got = stage_errors(estimate, actions, ["moves", "moves", "carries"])
    assert got == {"approach": [pytest.approx(0.5), 2], "carry": [0.0, 1]}


def test_ground_head_loss_weights_the_rare_named_movable():
    head = GroundHead(width=8, layer=2)
    rows = torch.randn(2, 6, 8)
    labels = torch.tensor([[0, 0, 1, 2, 0, 0], [0, 1, 0, 0, 2, 0]])
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.bias.copy_(torch.tensor([5.0, 0.0, 0.0]))  # says "other" everywhere
    loss, recall, obj = head.loss(rows, labels)
    assert float(obj.detach()) == 0  # no centre outputs
    assert recall == 0.0
    plain = torch.nn.functional.cross_entropy(head(rows).flatten(0, 1), labels.flatten())
    assert loss > plain  # the missed movable and container weigh 10 and 4 times
    with pytest.raises(ValueError, match="layer"):
        GroundHead(width=8, layer=0)
