"""Training-time real-time chunking in the flow loss (`train --prefix-max N`,
train/losses.py flow_terms): each sample's first d actions (the data's `held`,
world/executed_prefix.py) are given clean at flow time 0 and only the other rows are scored;
off, the loss draws and computes what it did before."""

import pytest
import torch

from embodied_kv.model.trained import world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import make_batch
from embodied_kv.train.forward import backbone_forward, expert_velocity
from embodied_kv.train.losses import flow_terms, sample_time
from embodied_kv.world.dataset import DataConfig, make_sample

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    cfg = world_config()
    tok = save_tokenizer(tmp_path_factory.mktemp("tok") / "tok.json")
    model = build_model(cfg, tokenizer_path=str(tok))
    data = DataConfig(horizon=cfg.action_horizon, prefix_max=8, prefix_detour=0.5)
    batch = make_batch([make_sample(data, s) for s in range(6)], model.tokenizer, cfg)
    plain = make_batch([make_sample(DataConfig(horizon=cfg.action_horizon), s)
                        for s in range(6)], model.tokenizer, cfg)  # fmt: skip
    with torch.no_grad():
        out = backbone_forward(model, batch)
    return model, batch, out, plain


@torch.no_grad()
def test_held_rows_are_given_clean_and_left_out_of_the_loss(rig):
    model, batch, out, _ = rig
    flow, real, estimate = flow_terms(model, out, batch, torch.Generator().manual_seed(3), 4)
    g = torch.Generator().manual_seed(3)  # the same draws, in flow_terms' order
    a = batch.actions
    b, h = a.shape[:2]
    noise = torch.randn(a.shape, generator=g)
    t = sample_time(b, g)
    d = batch.held
    assert d.max() > 0
    held = torch.arange(h)[None] < d[:, None]
    x_t = torch.where(held[..., None], a, t[:, None, None] * noise + (1 - t[:, None, None]) * a)
    v = expert_velocity(model, out, x_t, torch.where(held, 0.0, t[:, None]))
    err = ((v - (noise - a)) ** 2)[..., :4]
    assert torch.allclose(flow, err[~held].mean(), rtol=1e-6, atol=0)
    assert torch.equal(estimate[held], a[held])  # x_t is the action there, at t = 0


@torch.no_grad()
def test_off_is_the_loss_of_before(rig):
    model, _, _, plain = rig
    assert plain.held is None  # the run does not train it: no held rows
    with torch.no_grad():
        out = backbone_forward(model, plain)
    g = torch.Generator().manual_seed(5)
    flow, real, estimate = flow_terms(model, out, plain, g, 4)
    ref = torch.Generator().manual_seed(5)
    a = plain.actions
    noise = torch.randn(a.shape, generator=ref)
    t = sample_time(a.shape[0], ref)[:, None, None]
    v = expert_velocity(model, out, t * noise + (1 - t) * a, t[:, 0, 0])
    assert torch.equal(flow, torch.nn.functional.mse_loss(v[..., :4], (noise - a)[..., :4]))
    assert torch.equal(g.get_state(), ref.get_state())  # no extra draw


def test_the_flags_reach_the_data():
    from embodied_kv.cli import build_parser, train_config

    args = build_parser().parse_args(["train", "--steps", "1", "--prefix-max", "8",
                                      "--prefix-detour", "0.5"])  # fmt: skip
    data = train_config(args).data
    assert (data.prefix_max, data.prefix_detour) == (8, 0.5)
    bad = build_parser().parse_args(["train", "--steps", "1", "--prefix-detour", "0.5"])
    with pytest.raises(ValueError, match="need prefix_max"):
        train_config(bad)
