"""World samples -> padded tensors laid out as the engine lays out a request.

    full sequence of sample b:  [ I image tokens | prompt p_b | suffix + target + EOS | pad ]
                                 \\__ prefix P_b = I + p_b: bidirectional __/ \\_ causal _/
`ids` holds the text part only (the image tokens come from the vision tower). A label at
text index j is the id the model must produce after text token j (-100: no loss)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embodied_kv.model.config import ModelConfig
from embodied_kv.model.prompt import format_prompt
from embodied_kv.world.dataset import Sample

IGNORE = -100


@dataclass
class Batch:
    images: torch.Tensor  # [B, C, 3, S, S] in [-1, 1]
    ids: torch.Tensor  # [B, T] text ids, pad-filled
    prompt_len: torch.Tensor  # [B] p_b: prompt tokens (BOS included) in the prefix
    text_len: torch.Tensor  # [B] valid text tokens
    labels: torch.Tensor  # [B, T] next-token targets, IGNORE where no loss
    actions: torch.Tensor  # [B, H, A] expert chunks (A = the model's padded action_dim)
    kinds: list[str]

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to(self, device: torch.device) -> Batch:
        tensors = {k: v.to(device) for k, v in vars(self).items() if torch.is_tensor(v)}
        return Batch(**{**vars(self), **tensors})


def make_batch(samples: list[Sample], tokenizer, cfg: ModelConfig) -> Batch:
    """Tokenise like the engine: the prompt (model/prompt.py, truncated to
    max_text_tokens), then the suffix without BOS, then the target and EOS."""
    rows, prompt_lens, label_rows = [], [], []
    for s in samples:
        state = np.zeros(cfg.state_dim)
        state[: min(cfg.state_dim, s.state.shape[0])] = s.state[: cfg.state_dim]
        prompt = tokenizer.encode(format_prompt(s.instruction, state, cfg.state_bins))
        prompt = prompt[: cfg.max_text_tokens]
        suffix = tokenizer.encode(s.suffix, bos=False) if s.suffix else []
        target = tokenizer.encode(s.target, bos=False) + [tokenizer.eos_id]
        ids = prompt + suffix + target
        labels = [IGNORE] * len(ids)
        start = len(prompt) + len(suffix) - 1  # the token whose logits give target[0]
        labels[start : start + len(target)] = target
        rows.append(ids)
        prompt_lens.append(len(prompt))
        label_rows.append(labels)
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), t), IGNORE, dtype=torch.long)
    for b, (r, lab) in enumerate(zip(rows, label_rows, strict=True)):
        ids[b, : len(r)] = torch.tensor(r)
        labels[b, : len(lab)] = torch.tensor(lab)
    actions = torch.zeros(len(samples), cfg.action_horizon, cfg.action_dim)
    for b, s in enumerate(samples):
        a = torch.from_numpy(s.actions).float()
        if a.shape[0] != cfg.action_horizon or a.shape[1] > cfg.action_dim:
            raise ValueError(
                f"sample chunk {tuple(a.shape)} does not fit horizon {cfg.action_horizon} "
                f"x action_dim {cfg.action_dim}"
            )
        actions[b, :, : a.shape[1]] = a
    return Batch(
        images=torch.from_numpy(np.stack([s.images for s in samples])),
        ids=ids,
        prompt_len=torch.tensor(prompt_lens),
        text_len=torch.tensor([len(r) for r in rows]),
        labels=labels,
        actions=actions,
        kinds=[s.kind for s in samples],
    )
