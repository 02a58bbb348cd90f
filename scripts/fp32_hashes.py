#!/usr/bin/env python
"""Hashes of the fp32 CPU path's outputs (action chunks at several prefix lengths and seeds,
prefill and append logits) of the tiny preset, as JSON: run before and after a change and
diff the files to show the CPU path unchanged in bytes (docs/gpu_next.md). Hashes are per
CPU (GEMM rounding differs between CPUs): compare runs on one machine only.

    PYTHONPATH=$PWD .venv/bin/python scripts/fp32_hashes.py before.json
"""

import hashlib
import json
import sys

import torch

from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def hashes() -> dict[str, str]:
    out = {}
    m = build_model(get_preset("tiny"))
    for obs_seed in (1, 2):
        obs = synthetic_observation(m.cfg, obs_seed)
        for max_len in (256, 512):
            key = f"tiny/o{obs_seed}/L{max_len}"
            arena = m.new_arena(2, max_len)
            slot = arena.allocate()
            prefix = m.embed_prefix(obs)
            out[f"{key}/prefill_logits"] = digest(m.prefill(arena, slot, prefix))
            n = prefix.embeds.shape[0]
            for seed in (0, 5):
                chunk = m.sample_actions(arena, slot, n, m.make_noise(seed))
                out[f"{key}/s{seed}/chunk n={n}"] = digest(chunk)
            for p in (1, 17, n // 2):  # shorter prefixes of the same slot
                out[f"{key}/p{p}/chunk"] = digest(m.sample_actions(arena, slot, p, m.make_noise(3)))
            out[f"{key}/append"] = digest(m.append(arena, slot, torch.tensor([5, 9, 11])))
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    result = hashes()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(len(result), "entries")
