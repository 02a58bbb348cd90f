"""Training-time real-time chunking in the flow loss (`train --prefix-max N`,
train/losses.py flow_terms): each sample's first d actions are given clean at flow time 0
and only the other rows are scored; off, the loss draws and computes what it did before."""

import pytest
import torch

from embodied_kv.model.trained import world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.word_tokenizer import save_tokenizer
from embodied_kv.train.batch import make_batch
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.forward import backbone_forward, expert_velocity
from embodied_kv.train.losses import flow_terms, sample_time
from embodied_kv.world.dataset import DataConfig, make_sample

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    cfg = world_config()
    tok = save_tokenizer(tmp_path_factory.mktemp("tok") / "tok.json")
    model = build_model(cfg, tokenizer_path=str(tok))
    batch = make_batch([make_sample(DataConfig(), s) for s in range(4)], model.tokenizer, cfg)
    with torch.no_grad():
        out = backbone_forward(model, batch)
    return model, batch, out


@torch.no_grad()
def test_held_rows_are_given_clean_and_left_out_of_the_loss(rig):
    model, batch, out = rig
    flow, real, estimate = flow_terms(model, out, batch, torch.Generator().manual_seed(3), 4, 8)
    g = torch.Generator().manual_seed(3)  # the same draws, in flow_terms' order
    a = batch.actions
    b, h = a.shape[:2]
    noise = torch.randn(a.shape, generator=g)
    t = sample_time(b, g)
    d = torch.randint(0, 9, (b,), generator=g)
    assert d.max() > 0
    held = torch.arange(h)[None] < d[:, None]
    x_t = torch.where(held[..., None], a, t[:, None, None] * noise + (1 - t[:, None, None]) * a)
    v = expert_velocity(model, out, x_t, torch.where(held, 0.0, t[:, None]))
    err = ((v - (noise - a)) ** 2)[..., :4]
    assert torch.allclose(flow, err[~held].mean(), rtol=1e-6, atol=0)
    assert torch.equal(estimate[held], a[held])  # x_t is the action there, at t = 0


@torch.no_grad()
def test_off_is_the_loss_of_before(rig):
    model, batch, out = rig
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    off = flow_terms(model, out, batch, g1, 4)
    zero = flow_terms(model, out, batch, g2, 4, 0)
    assert all(torch.equal(x, y) for x, y in zip(off, zero, strict=True))
    assert torch.equal(g1.get_state(), g2.get_state())  # no extra draw


def test_config_refuses_a_negative_prefix():
    with pytest.raises(ValueError, match="prefix_max"):
        TrainConfig(steps=1, prefix_max=-1)
    from embodied_kv.cli import build_parser, train_config

    args = build_parser().parse_args(["train", "--steps", "1", "--prefix-max", "8"])
    assert train_config(args).prefix_max == 8
