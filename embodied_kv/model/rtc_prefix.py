"""Training-time real-time chunking (Black, Ren, Equi, Levine 2025, "Training-Time Action
Conditioning for Efficient Real-Time Chunking", arXiv 2512.05964): `rtc.guidance: prefix`.

Inference-time guidance (model/rtc.py) pulls the new chunk towards the old one at every
Euler step; `error` pulls the stale rows off the expert's manifold (they get far cleaner
than their flow time says) and costs task success, `vjp` stays on it and hardly joins
(docs/rtc.md). Here the d stale actions are given, clean: their rows of x are the previous
chunk's actions at flow time 0 at every step (their own adaRMS modulation, t = 0), and the
other rows are denoised from noise as usual, attending to them. A model learns to continue
such a prefix when trained with `train --prefix-max D` (train/losses.py `flow_terms`: d
drawn per sample, the prefix rows clean at t = 0, the loss on the other rows); nothing runs
beyond the plain loop and a row select per step.

    index i:   0 ........ d-1 | d ............. H-1
    x rows:    Y (t = 0)      | noise -> chunk (t_k)        W_i = 1 exactly on i < d

With no row held (d = 0) the steps are the plain loop's ops on the same values: its bytes
(CPU; on CUDA the plain loop runs the fused kernels, which take one modulation row).

The rows of W's schedule after the held ones (0 < W < 1: `rtc.schedule` exp or linear,
over `rtc.band` rows or up to H - s) are pulled towards the old chunk as `guidance: error`
pulls them (v - g_k W (Y - (x - t v)), g_k = min(beta, ...)): a policy trained on
executed prefixes already continues from the held rows, and the band eases its first free
actions into the old plan's. `hard` (W 0 after d) or no `gs` (beta = 0): the held rows
alone, the bytes of before.
"""

from __future__ import annotations

import dataclasses

import torch

from embodied_kv.model.expert import Modulation
from embodied_kv.model.flow_constants import CLEAN
from embodied_kv.storage.arena import KVArena


def row_modulation(held: torch.Tensor, clean: Modulation, mod: Modulation, k: int) -> Modulation:
    """held [H, 1] bool -> the modulation of step k per row [N, 1, H, W]: t = 0's (`clean`,
    [N, 1, W]) on held rows, step k's (`mod`, [N, S, W]) elsewhere."""

    def pick(c: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.where(held[None], c[:, 0, None], m[:, k, None])[:, None]

    return Modulation(pick(clean.scale1, mod.scale1), pick(clean.shift, mod.shift),
                      pick(clean.gate, mod.gate))  # fmt: skip


@torch.no_grad()
def sample_prefixed(expert, arena: KVArena, slot: int, prefix_len, noise: torch.Tensor,
                    target: torch.Tensor, weights: torch.Tensor, rows: int | None = None,
                    layer_rows: torch.Tensor | None = None,
                    gs: list[float] | None = None) -> torch.Tensor:  # fmt: skip
    """ActionExpert.sample with the rows where `weights` is 1 (the d stale actions) held at
    `target` (the previous chunk, model units) -> chunk [H, A] fp32, those rows equal to
    target's; the rows where 0 < W < 1 guided towards it with g_k = `gs[k]` at step k
    (model/rtc.py guidance_weights; module doc), None: not guided. No host reads of device
    values (a graph's static buffers may be passed)."""
    steps = expert.cfg.denoise_steps
    dt = -1.0 / steps
    held = (weights == 1.0)[:, None]  # [H, 1]
    band = torch.where(held, 0.0, weights[:, None].float())  # [H, 1]: 0 on held rows
    y = target.float()
    x = torch.where(held, y, noise.float())
    mod = expert.flow_modulation(steps, x.device)  # that of t_k, kept across actions
    clean = expert.flow_modulation(CLEAN, x.device)  # t = 0 [N, 1, W], kept likewise
    ctx = expert.context(None, x.shape[0], prefix_len, rows, x.device, layer_rows, mod)
    for k in range(steps):
        step = dataclasses.replace(ctx, modulation=row_modulation(held, clean, mod, k))
        v = expert.velocity_at(x, step, 0, arena, slot, prefix_len).float()
        if gs is not None:
            v = v - gs[k] * band * (y - (x - (1.0 + k * dt) * v))
        x = torch.where(held, y, x + dt * v)
    return x
