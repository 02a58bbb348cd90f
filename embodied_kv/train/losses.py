"""pi0.5's training losses on one batch: next-token cross-entropy on the text targets
and flow matching for the action expert.

Flow matching (openpi pi0.py `compute_loss`): x_t = t * noise + (1 - t) * actions,
target velocity u = noise - actions, t ~ Beta(1.5, 1) * 0.999 + 0.001 (openpi
`sample_time`: more weight near t = 1, the noisy end); loss = mean (v - u)^2. The
engine integrates dx/dt = v from t = 1 to 0 (model/expert.py), which this trains."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from embodied_kv.train.action_bins import (
    action_id_range,
    bin_error,
    first_step_weights,
    token_losses,
)
from embodied_kv.train.batch import IGNORE, Batch
from embodied_kv.train.forward import backbone_forward, expert_velocity, text_logits
from embodied_kv.train.grounding import GroundHead, object_loss
from embodied_kv.train.names import name_loss
from embodied_kv.world.expert import STAGES
from embodied_kv.world.render import LABELS
from embodied_kv.world.scene import REAL_ACTION_DIMS

BETA_A, BETA_B = 1.5, 1.0  # openpi sample_time
REAL = REAL_ACTION_DIMS


@dataclass
class Losses:
    total: torch.Tensor
    text: float
    flow: float
    text_acc: float  # share of target tokens predicted right (greedy), teacher-forced
    # per sample kind: [right, counted] over the target tokens' first ids of each turn
    # (the answer word / first action id), the figure eval measures
    first_right: dict[str, list[int]]
    n_text: int  # target tokens in the batch
    n_samples: int
    patch: float = 0.0  # auxiliary patch-class cross-entropy (0 without a head)
    patch_acc: float = 0.0
    # per sample kind: [right, counted] over whole turns, every target token and the EOS
    # right (a two-hop path answer's first word, "in", says nothing of its place)
    whole_right: dict[str, list[int]] = field(default_factory=dict)
    # per task stage (expert.STAGES): [sum, count] of the xy distance between the first
    # action's one-step estimate x_t - t v and the expert's (table units)
    stage_err: dict[str, list[float]] = field(default_factory=dict)
    flow_real: float = 0.0  # the flow loss over the real action dims (scene.REAL_ACTION_DIMS)
    ground: float = 0.0  # grounding head's weighted cross-entropy (0 without the head)
    ground_recall: float = 0.0  # share of the named movable's patches the head finds
    position: float = 0.0  # the patch head's position regression (MSE; 0 when off)
    object: float = 0.0  # the patch head's object-centre regression (MSE; 0 when off)
    object_rows: float = 0.0  # the same from the grounding head's rows (0 without the head)
    # [sum, count] of |greedy bin - target bin| in action units over the `bins` action ids
    bins_err: tuple[float, int] = (0.0, 0)
    names: float = 0.0  # the named things' position from their names' rows (0 when off)
    # bins_err over each `actions` sample's first id only (predicted at the prompt's last
    # row from the image and the instruction: what the `ar` mode gets wrong first)
    bins_err_first: tuple[float, int] = (0.0, 0)


def sample_time(b: int, generator: torch.Generator) -> torch.Tensor:
    """openpi: beta(1.5, 1) * 0.999 + 0.001 -> [b]. Drawn through the inverse CDF of
    Beta(a, 1) (u ** (1 / a)) so the seeded generator decides it."""
    u = torch.rand(b, generator=generator)
    return u.pow(1.0 / BETA_A) * 0.999 + 0.001


def compute_losses(
    model, batch: Batch, generator: torch.Generator, flow_weight: float = 1.0,
    sample_share: float = 1.0, patch_head: torch.nn.Module | None = None,
    patch_weight: float = 1.0, flow_dims: int = 0, ground_head: GroundHead | None = None,
    ground_weight: float = 0.0, position_weight: float = 0.0, object_weight: float = 0.0,
    bin_sigma: float = 0.0, bin_weight: float = 1.0, name_weight: float = 0.0,
    bin_first: float = 1.0,
) -> Losses:
    """Mean losses of the batch; `total` weighs them by the batch's share of the step's
    samples (a step split into length buckets sums to the full means). The text loss is
    the mean over samples of each sample's mean token loss: an `actions` sample's 80 ids
    weigh as much as a plan's few answer words (per token, the action ids would be three
    quarters of the text loss and the answers a few percent). `flow_dims` > 0: the flow
    loss over the first flow_dims action dims only (the world's real ones; 0 = all).
    `bin_sigma` > 0: the `bins` action ids against soft targets that many bins wide
    (train/action_bins.py; 0 = one-hot, as every other token), their losses times
    `bin_weight`, the first step's ids' times `bin_first` more. `name_weight` > 0: the
    grounding head's object outputs also regress the
    position of each thing the text names from its name's row (train/names.py)."""
    out = backbone_forward(model, batch, ground_head.layer if ground_head is not None else 0)
    rows, cols = (batch.labels != IGNORE).nonzero(as_tuple=True)
    logits = text_logits(model, out, rows, cols)  # [N, V]
    targets = batch.labels[rows, cols]
    lo, n = action_id_range(model.cfg)
    tokens = token_losses(logits, targets, lo, n, bin_sigma, bin_weight)
    starts = turn_starts(batch, rows, cols)
    if bin_first != 1.0:
        dims = model.cfg.action_dim
        tokens = tokens * first_step_weights(targets, starts, lo, n, dims, bin_first)
    text = per_sample_mean(tokens, rows, batch.size)
    right = logits.argmax(-1) == targets
    acc = right.float().mean()
    flow, real, estimate = flow_terms(model, out, batch, generator, flow_dims)
    total = text + flow_weight * flow
    ground = obj_rows = names = torch.zeros(())
    recall = 0.0
    if ground_head is not None and batch.ground is not None:
        ground, recall, obj_rows = ground_head.loss(out.tapped, batch.ground, batch.centres)
        total = total + ground_weight * ground + object_weight * obj_rows
        if name_weight > 0 and batch.names_at is not None:
            names = name_loss(ground_head, out.tapped_text, batch.names_at, batch.names_xy)
            total = total + name_weight * names
    patch = patch_acc = position = obj = torch.zeros(())
    if patch_head is not None:  # [B, I, K] vs [B, I] (then [B, I, 2] position, object)
        outputs = patch_head(out.images.float())
        patch_logits = outputs[..., : len(LABELS)]
        patch = F.cross_entropy(patch_logits.flatten(0, 1), batch.patches.flatten())
        patch_acc = (patch_logits.argmax(-1) == batch.patches).float().mean()
        total = total + patch_weight * patch
        extra = outputs[..., len(LABELS) :].split(2, dim=-1)  # head_outputs' order
        if position_weight > 0:
            target = position_targets(batch.images.shape[1], out.image_tokens, outputs.device)
            position = F.mse_loss(extra[0], target.expand_as(extra[0]))
            total = total + position_weight * position
        if object_weight > 0:
            obj = object_loss(extra[-1], batch.centres)
            total = total + object_weight * obj
    first, whole = turn_counts(batch, rows, starts, right)
    return Losses(total * sample_share, float(text.detach()), float(flow.detach()),
                  float(acc), first, int(rows.numel()), batch.size, float(patch.detach()),
                  float(patch_acc), whole, stage_errors(estimate, batch.actions, batch.phases),
                  float(real), float(ground.detach()), recall,
                  float(position.detach()), float(obj.detach()),
                  float(obj_rows.detach()), bin_error(logits.detach(), targets, lo, n),
                  float(names.detach()), bin_error(logits.detach()[starts], targets[starts],
                                                   lo, n))  # fmt: skip


def head_outputs(position: bool, centres: bool) -> int:
    """The patch head's outputs: a logit per render.LABELS class, then a (column, row)
    pair with the position regression, then a table (x, y) pair with the object one."""
    return len(LABELS) + 2 * int(position) + 2 * int(centres)


def position_targets(cameras: int, image_tokens: int, device=None) -> torch.Tensor:
    """[1, I, 2]: each image token's patch column and row in [-1, 1] (cameras in turn,
    each a square grid of patches in row-major order, as the vision tower emits them)."""
    per = image_tokens // cameras
    side = math.isqrt(per)
    if side * side != per or per * cameras != image_tokens:
        raise ValueError(f"{image_tokens} image tokens are not {cameras} square patch grids")
    p = torch.arange(image_tokens, device=device) % per
    grid = torch.stack([p % side, p // side], dim=-1).float()
    return (grid / max(side - 1, 1) * 2 - 1)[None]


def expert_losses(
    model, batch: Batch, generator: torch.Generator, sample_share: float = 1.0,
    flow_dims: int = 0,
) -> Losses:
    """The flow loss alone with the backbone frozen (knowledge insulation: pi0.5 stops the
    action expert's gradient at the VLM, so the text skills stay as they are): the
    backbone runs without autograd over the prefix only (images, prompt; the text turns
    are not needed) and only the expert's parameters get gradients."""
    with torch.no_grad():
        out = backbone_forward(model, prefix_only(batch))
    flow, real, estimate = flow_terms(model, out, batch, generator, flow_dims)
    return Losses(flow * sample_share, 0.0, float(flow.detach()), 0.0, {}, 0, batch.size,
                  stage_err=stage_errors(estimate, batch.actions, batch.phases),
                  flow_real=float(real))  # fmt: skip


def prefix_only(batch: Batch) -> Batch:
    """`batch` cut to its prefixes: ids up to the longest prompt, no text targets."""
    t = int(batch.prompt_len.max())
    return replace(batch, ids=batch.ids[:, :t], text_len=batch.prompt_len.clone(),
                   labels=torch.full_like(batch.labels[:, :t], IGNORE))  # fmt: skip


def flow_terms(model, out, batch: Batch, generator: torch.Generator, flow_dims: int):
    """-> (flow loss over the first flow_dims dims (0: all), its value over the real dims
    (detached), the one-step estimate x_t - t v of the clean chunk (detached)).

    `batch.held` (training-time real-time chunking, model/rtc_prefix.py; the data's
    `prefix_max`, world/executed_prefix.py): each sample's first held actions are given
    clean at flow time 0 and the loss covers the other rows; None: the loss of before."""
    actions = batch.actions
    # drawn on the CPU from the seeded generator: the same noise on every device
    noise = torch.randn(actions.shape, generator=generator).to(actions.device)
    t = sample_time(actions.shape[0], generator).to(actions.device)
    tt = t[:, None, None]
    x_t = tt * noise + (1 - tt) * actions
    dims = flow_dims or actions.shape[-1]
    if batch.held is None:
        v = expert_velocity(model, out, x_t, t)
        flow = F.mse_loss(v[..., :dims], (noise - actions)[..., :dims])
        real = F.mse_loss(v[..., :REAL], (noise - actions)[..., :REAL]).detach()
        return flow, real, (x_t - tt * v).detach()
    h = actions.shape[1]
    d = batch.held.to(actions.device)
    held = torch.arange(h, device=actions.device)[None] < d[:, None]  # [B, H]
    x_t = torch.where(held[..., None], actions, x_t)
    t_rows = torch.where(held, torch.zeros_like(t)[:, None], t[:, None])  # [B, H]
    v = expert_velocity(model, out, x_t, t_rows)
    free = ~held
    err = (v - (noise - actions)) ** 2
    flow = err[..., :dims][free].mean()
    real = err[..., :REAL][free].mean().detach()
    return flow, real, (x_t - t_rows[..., None] * v).detach()


def stage_errors(estimate: torch.Tensor, actions: torch.Tensor, phases) -> dict:
    """Per task stage [sum, count] of the first action's xy distance (estimate [B, H, A]
    vs actions [B, H, A])."""
    if phases is None:
        return {}
    dist = (estimate[:, 0, :2] - actions[:, 0, :2]).norm(dim=-1).tolist()
    out: dict[str, list[float]] = {}
    for phase, d in zip(phases, dist, strict=True):
        add_counts(out, {STAGES[phase]: [d, 1]})
    return out


def per_sample_mean(loss: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[N] token losses of rows [N] (sample index) -> the mean over samples with any
    target of their mean token loss."""
    total = torch.zeros(n, dtype=loss.dtype, device=loss.device).index_add(0, rows, loss)
    count = torch.zeros(n, dtype=loss.dtype, device=loss.device).index_add(
        0, rows, torch.ones_like(loss)
    )
    has = count > 0
    return (total[has] / count[has]).mean()


def turn_counts(batch: Batch, rows, starts, right) -> tuple[dict, dict]:
    """Per kind [right, counted] over each turn's first target token (`starts`, from
    turn_starts), and over whole turns (every token of the turn right)."""
    first: dict[str, list[int]] = {}
    whole: dict[str, list[int]] = {}
    turn: list = []  # [kind, all right so far] of the open turn
    for r, f, ok in zip(rows.tolist(), starts.tolist(), right.tolist(), strict=True):
        if f:
            if turn:
                add_counts(whole, {turn[0]: [int(turn[1]), 1]})
            turn = [batch.kinds[r], True]
            add_counts(first, {batch.kinds[r]: [int(ok), 1]})
        turn[1] = turn[1] and ok
    if turn:
        add_counts(whole, {turn[0]: [int(turn[1]), 1]})
    return first, whole


def turn_starts(batch: Batch, rows, cols) -> torch.Tensor:
    """[N] bool: the target token is its turn's first (its label follows an unlabelled
    position; an `actions` sample's first action id)."""
    lab = batch.labels
    return torch.where(cols > 0, lab[rows, (cols - 1).clamp(min=0)], IGNORE) == IGNORE


def add_counts(into: dict[str, list], counts: dict[str, list]) -> None:
    """Per-kind [right, counted] (or [sum, counted]) pairs of `counts` added into `into`."""
    for kind, (right, n) in counts.items():
        total = into.setdefault(kind, [0, 0])
        total[0], total[1] = total[0] + right, total[1] + n
