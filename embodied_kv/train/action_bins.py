"""The `bins` action ids in training: soft targets over neighbouring bins and the error of
the greedy bin in action units (issue 34: `action_mode: ar` needs a model that acts).

With one-hot targets a bin one step off costs as much as one at the other end of [-1, 1]:
nothing in the cross-entropy says which wrong bins are close, and the logged first-id
accuracy (exact bin of 256, 0.0078 wide) stayed 0.0 for thousands of steps while the flow
head's estimate was within ~0.1. HL-Gauss (Imani & White 2018, "Improving Regression
Performance with Distributional Losses"; Farebrother et al. 2024, "Stop Regressing") trains
a classifier over bins against a Gaussian of width `sigma` bins around the target,
integrated over each bin: the gradient then points towards the right value from anywhere
near it, and the argmax (the engine's constrained greedy decode) still lands on one bin.

Bin k (0..255) is the id `lo + k`; BinTokenizer's ids run downwards in value (id = top - bin),
so neighbours in id are neighbours in value either way and the Gaussian is symmetric.

`weight` scales the action ids' losses against the other text tokens'. The loss is a
mean per sample, and an `actions` sample's 80 ids are mostly easy (teacher-forced, the
chunk holds its first step's target: the ids after the first step copy it; 4 of the 8 dims
are always 0), so the two ids that carry the task (step 0's x and y) are 1/40 of a sample
that is 15 % of the mix. Measured on the shipped weights (32 held-out samples, greedy bin,
teacher-forced): step 0's x and y off by 0.59 and 0.45 in action units, the later steps'
by 0.00-0.10; the closed `ar` loop's approach error 0.756 (flow: 0.228)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from embodied_kv.model.action_tokens import BINS, BinTokenizer, reserved_tail, text_ids

BIN_WIDTH = 2.0 / (BINS - 1)  # value units per bin: OpenVLA's 256 edges over [-1, 1]


def action_id_range(cfg) -> tuple[int, int]:
    """(lo, n): the `bins` ids are lo .. lo + n - 1, as the model's BinTokenizer lays them."""
    ids = BinTokenizer(cfg.vocab_size, cfg.action_horizon, cfg.action_dim, reserved_tail(cfg),
                       text_ids(cfg)).action_ids()  # fmt: skip
    return int(ids[0]), int(ids.numel())


def soft_targets(k: torch.Tensor, n: int, sigma: float) -> torch.Tensor:
    """[N] target bins -> [N, n]: a normal of std `sigma` bins around each, integrated
    over each bin [j - 0.5, j + 0.5) and renormalised over the n bins (the edges)."""
    if sigma <= 0:
        raise ValueError(f"sigma={sigma} must be > 0 (0: plain one-hot cross-entropy)")
    j = torch.arange(n + 1, dtype=torch.float64, device=k.device) - 0.5  # bin edges
    z = (j[None, :] - k.to(torch.float64)[:, None]) / (sigma * math.sqrt(2.0))
    cdf = 0.5 * (1.0 + torch.erf(z))
    mass = cdf[:, 1:] - cdf[:, :-1]
    return (mass / mass.sum(-1, keepdim=True)).float()


def token_losses(logits: torch.Tensor, targets: torch.Tensor, lo: int, n: int,
                 sigma: float = 0.0, weight: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Per-token loss [N]: cross-entropy against the target id, and for targets among
    the action ids (when sigma > 0) against the soft bins (the rest of the vocabulary's
    probability counts as wrong in both); the action ids' losses times `weight`."""
    loss = F.cross_entropy(logits, targets, reduction="none")
    act = (targets >= lo) & (targets < lo + n)
    if not bool(act.any()) or (sigma <= 0 and weight == 1.0):
        return loss
    if sigma > 0:
        logp = F.log_softmax(logits[act].float(), dim=-1)[:, lo : lo + n]
        q = soft_targets(targets[act] - lo, n, sigma)
        loss = loss.masked_scatter(act, -(q * logp).sum(-1).to(loss.dtype))
    return torch.where(act, loss * weight, loss)


def bin_error(logits: torch.Tensor, targets: torch.Tensor, lo: int, n: int) -> tuple[float, int]:
    """(sum, count) of |greedy bin - target bin| in action units over the targets that are
    action ids; greedy among the action ids only, as the `ar` decode constrains it."""
    act = (targets >= lo) & (targets < lo + n)
    if not bool(act.any()):
        return 0.0, 0
    pred = logits[act][:, lo : lo + n].argmax(-1)
    err = (pred - (targets[act] - lo)).abs().float() * BIN_WIDTH
    return float(err.sum()), int(act.sum())


def first_step_weights(targets: torch.Tensor, starts: torch.Tensor, lo: int, n: int,
                       dims: int, weight: float) -> torch.Tensor:  # fmt: skip
    """[N] loss factors: `weight` on the first `dims` action ids of each `actions` sample
    (the chunk's first step, what the observation alone decides; teacher-forced, every
    later step copies or extends it), 1 elsewhere. `starts` [N] bool: each turn's first
    target (train/losses.py turn_starts)."""
    out = torch.ones(targets.shape[0], dtype=torch.float32, device=targets.device)
    act = (targets >= lo) & (targets < lo + n)
    first = (starts & act).nonzero(as_tuple=True)[0]
    if weight == 1.0 or first.numel() == 0:
        return out
    at = (first[:, None] + torch.arange(dims, device=targets.device)[None, :]).flatten()
    at = at[at < targets.shape[0]]
    out[at[act[at]]] = weight
    return out


def noisy_inputs(ids: torch.Tensor, lo: int, n: int, share: float,
                 generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """ids [B, T] with each input `bins` action id replaced, with probability `share`, by a
    uniformly drawn one (the labels stay the expert's). Teacher forcing shows the model
    only right action ids; the `ar` decode feeds back its own, and one wrong id sent the
    rest of the chunk astray (measured on the arx weights: after a first y id 0.9 off, the
    gripper and the four always-zero dims decoded at the far end of [-1, 1]). Trained with
    wrong ids in the context, each id follows the image and its position in the chunk."""
    if share <= 0:
        return ids
    act = (ids >= lo) & (ids < lo + n)
    draw = torch.rand(ids.shape, generator=generator).to(ids.device) < share
    rand = torch.randint(lo, lo + n, ids.shape, generator=generator).to(ids.device)
    return torch.where(act & draw, rand, ids)
