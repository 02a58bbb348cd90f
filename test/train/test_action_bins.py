"""Soft targets for the `bins` action ids (HL-Gauss), their loss weight and the greedy
bin's error: against float64 references written here, and through a real training step."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from embodied_kv.model.action_tokens import BINS, BinTokenizer
from embodied_kv.model.trained import world_config
from embodied_kv.train.action_bins import (
    BIN_WIDTH,
    action_id_range,
    bin_error,
    first_step_weights,
    noisy_inputs,
    soft_targets,
    token_losses,
)
from embodied_kv.train.config import TrainConfig
from embodied_kv.train.loop import train
from embodied_kv.world.dataset import DataConfig


def _reference_targets(k: int, n: int, sigma: float) -> list[float]:
    """Normal mass over [j - 0.5, j + 0.5), renormalised, in plain float64."""

    def cdf(x):
        return 0.5 * (1 + math.erf((x - k) / (sigma * math.sqrt(2))))

    mass = [cdf(j + 0.5) - cdf(j - 0.5) for j in range(n)]
    return [m / sum(mass) for m in mass]


@pytest.mark.parametrize("k, sigma", [(0, 1.0), (17, 3.0), (255, 2.0), (128, 0.4)])
def test_soft_targets_are_the_normal_integrated_over_each_bin(k, sigma):
    q = soft_targets(torch.tensor([k]), BINS, sigma)[0]
    ref = torch.tensor(_reference_targets(k, BINS, sigma), dtype=torch.float32)
    torch.testing.assert_close(q, ref, atol=1e-7, rtol=1e-5)
    assert abs(float(q.sum()) - 1) < 1e-5 and int(q.argmax()) == k
    if 0 < k < BINS - 1:  # symmetric away from the edges
        torch.testing.assert_close(q[k - 1], q[k + 1])
    with pytest.raises(ValueError, match="sigma"):
        soft_targets(torch.tensor([k]), BINS, 0.0)


def test_the_action_range_is_the_bins_tokenizers():
    cfg = world_config()
    lo, n = action_id_range(cfg)
    ids = BinTokenizer(cfg.vocab_size, cfg.action_horizon, cfg.action_dim, 0, 384).action_ids()
    assert (lo, n) == (int(ids[0]), BINS) and int(ids[-1]) == lo + n - 1


def _logits_and_targets(lo: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen) * 3
    targets = torch.tensor([3, lo, lo + 100, 7, lo + BINS - 1, lo + 5])
    return logits, targets


def test_token_losses_change_only_the_action_ids():
    lo, vocab = 40, 40 + BINS + 3
    logits, targets = _logits_and_targets(lo, vocab)
    plain = F.cross_entropy(logits, targets, reduction="none")
    assert torch.equal(token_losses(logits, targets, lo, BINS), plain)  # sigma 0, weight 1
    soft = token_losses(logits, targets, lo, BINS, sigma=2.5, weight=3.0)
    act = (targets >= lo) & (targets < lo + BINS)
    assert torch.equal(soft[~act], plain[~act])
    logp = torch.log_softmax(logits.double(), -1)
    for i in act.nonzero().flatten().tolist():
        q = torch.tensor(_reference_targets(int(targets[i]) - lo, BINS, 2.5), dtype=torch.float64)
        want = -3.0 * float((q * logp[i, lo : lo + BINS]).sum())
        assert abs(float(soft[i]) - want) < 1e-4 * abs(want)
    weighted = token_losses(logits, targets, lo, BINS, weight=2.0)
    torch.testing.assert_close(weighted, torch.where(act, 2 * plain, plain))


def test_bin_error_is_the_greedy_bins_distance_among_the_action_ids():
    lo, vocab = 40, 40 + BINS + 3
    logits = torch.zeros(3, vocab)
    targets = torch.tensor([lo + 10, lo + 200, 5])
    logits[0, lo + 13] = 5.0  # 3 bins off
    logits[1, lo + 200] = 5.0  # right
    logits[1, 2] = 9.0  # a text id scores higher: not an action id, not decoded
    logits[2, lo] = 5.0  # a text target: not counted
    total, count = bin_error(logits, targets, lo, BINS)
    assert count == 2 and abs(total - 3 * BIN_WIDTH) < 1e-6
    assert bin_error(logits[2:], targets[2:], lo, BINS) == (0.0, 0)


DATA = DataConfig(text_mix=(0.2, 0.2, 0.0, 0.6), turns=2, memory_objects=3, memory_updates=2)


def test_a_run_logs_the_bin_error_and_the_flags_reach_it(tmp_path):
    from embodied_kv.cli import build_parser, train_config

    recipe = dict(batch=4, curriculum=0, warmup=1, log_every=1, ckpt_every=100, data=DATA)
    log = train(TrainConfig(out=str(tmp_path / "a"), steps=2, bin_sigma=3.0, bin_weight=4.0,
                            bin_first=2.0, bin_noise=0.2, **recipe), progress=False)  # fmt: skip
    assert all(r["bins_err"] is not None and 0 <= r["bins_err"] <= 2 for r in log)
    assert all(r["bins_err_first"] is not None and 0 <= r["bins_err_first"] <= 2 for r in log)
    saved = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["bins_err"] for r in saved] == [r["bins_err"] for r in log]
    args = build_parser().parse_args(
        ["train", "--steps", "1", "--bin-sigma", "2", "--bin-weight", "4", "--bin-first", "3",
         "--bin-noise", "0.2"]
    )  # fmt: skip
    cfg = train_config(args)
    assert (cfg.bin_sigma, cfg.bin_weight, cfg.bin_first, cfg.bin_noise) == (2.0, 4.0, 3.0, 0.2)
    for bad in (dict(bin_sigma=-1.0), dict(bin_weight=0.0), dict(bin_first=0.0),
                dict(bin_noise=1.0), dict(bin_noise=-0.1)):  # fmt: skip
        with pytest.raises(ValueError, match="bin_"):
            TrainConfig(steps=1, **bad)


def test_first_step_weights_fall_on_each_action_samples_first_step():
    lo, dims = 40, 3
    # two samples flattened: a text turn (2 targets) then 6 action ids (2 steps of 3 dims),
    # then an action sample cut after 2 ids, then a text turn
    targets = torch.tensor([5, 6, lo + 1, lo + 2, lo + 3, lo + 4, lo + 5, lo + 6,
                            lo + 7, lo + 8, 7, 8])  # fmt: skip
    starts = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1, 0], dtype=torch.bool)
    w = first_step_weights(targets, starts, lo, BINS, dims, 4.0)
    assert w.tolist() == [1, 1, 4, 4, 4, 1, 1, 1, 4, 4, 1, 1]
    assert torch.equal(first_step_weights(targets, starts, lo, BINS, dims, 1.0), torch.ones(12))


def test_noisy_inputs_replace_only_action_ids_with_action_ids_at_the_share():
    lo = 40
    ids = torch.cat([torch.arange(30).repeat(40, 1), torch.full((40, 60), lo + 7)], dim=1)
    gen = torch.Generator().manual_seed(3)
    out = noisy_inputs(ids, lo, BINS, 0.25, gen)
    assert torch.equal(out[:, :30], ids[:, :30])  # text ids untouched
    act = out[:, 30:]
    assert bool(((act >= lo) & (act < lo + BINS)).all())
    changed = float((act != lo + 7).float().mean())
    assert 0.2 < changed < 0.3  # 2,400 draws at 0.25 (x 255/256 that land elsewhere)
    again = noisy_inputs(ids, lo, BINS, 0.25, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)  # the generator decides
    assert noisy_inputs(ids, lo, BINS, 0.0, gen) is ids
