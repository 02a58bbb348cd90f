"""`python -m embodied_kv.eval.position_probe`: can the action expert read where a patch is?

The action expert reads the backbone's keys and values of the image tokens; an approach
target is the named object's table position, so the patch's column (x) and row (y) must
be recoverable from what it reads. This fits a linear map (least squares, on half of the
image tokens of `--samples` world frames, the other half held out) from each layer's
values, keys (after RoPE) and the projected image tokens to the patch's column and row
in [-1, 1], and prints the held-out R² per target. R² near 0 for the column: x is not a
linear part of what the expert reads (issue 34: the shipped step-1,800 weights).
It also fits, over the tokens whose patch shows a thing, the table x and y of that thing
(world/dataset.py object_centres): what the expert needs for an approach target, finer
than the patch grid (8 columns of 0.25 table units at 64 px).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from embodied_kv.eval.world import default_weights
from embodied_kv.model.trained import load_trained
from embodied_kv.train.batch import make_batch
from embodied_kv.train.forward import backbone_forward
from embodied_kv.train.losses import position_targets, prefix_only
from embodied_kv.world.dataset import DataConfig, make_sample

PROBE_SEED_BASE = 10**9  # frames apart from the first training steps' samples


def held_out_r2(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Fit y [N, 2] ~ x [N, F] + 1 on the first half, -> R² per column on the second."""
    x = np.concatenate([x, np.ones((x.shape[0], 1))], axis=1)
    n = x.shape[0] // 2
    w, *_ = np.linalg.lstsq(x[:n], y[:n], rcond=None)
    err = ((x[n:] @ w - y[n:]) ** 2).sum(0)
    return 1 - err / ((y[n:] - y[n:].mean(0)) ** 2).sum(0)


@torch.no_grad()
def probe(model, samples: int) -> dict[str, list[float]]:
    """-> {"values L", "keys L" per backbone layer L, "image tokens"}: [R² column, R² row,
    R² object x, R² object y]."""
    data = DataConfig(rollout="task", text_mix=(0, 0, 1, 0))
    batch = make_batch([make_sample(data, PROBE_SEED_BASE + i) for i in range(samples)],
                       model.tokenizer, model.cfg)  # fmt: skip
    out = backbone_forward(model, prefix_only(batch))
    n_img, b = out.image_tokens, batch.size
    target = position_targets(batch.images.shape[1], n_img)[0].repeat(b, 1).numpy()
    centres = batch.centres.reshape(b * n_img, 2).numpy()
    shown = np.isfinite(centres[:, 0])

    def fits(x: np.ndarray) -> list[float]:
        return [*held_out_r2(x, target), *held_out_r2(x[shown], centres[shown])]

    def rows(t: torch.Tensor) -> np.ndarray:  # [B, Hkv, L, D] -> [B * I, Hkv * D]
        return t[:, :, :n_img].permute(0, 2, 1, 3).reshape(b * n_img, -1).float().numpy()

    result = {}
    for i, (k, v) in enumerate(zip(out.keys, out.values, strict=True)):
        result[f"values {i}"] = fits(rows(v))
        result[f"keys {i}"] = fits(rows(k))
    result["image tokens"] = fits(out.images.reshape(b * n_img, -1).float().numpy())
    return {k: [float(x) for x in v] for k, v in result.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=None, help="default: the shipped world weights")
    p.add_argument("--tokenizer", default="", help="default: tokenizer.json beside the weights")
    p.add_argument("--samples", type=int, default=48)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    weights = a.weights or default_weights()
    result = probe(load_trained(weights, a.tokenizer or None), a.samples)
    for name, (col, row, ox, oy) in result.items():
        print(f"{name:>13}: R² column {col:6.3f}  row {row:6.3f}  object x {ox:6.3f}  "
              f"object y {oy:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
