"""World samples -> padded tensors laid out as the engine lays out a request.

    full sequence of sample b:  [ I image tokens | prompt p_b | turns | pad ]
                                 \\__ prefix P_b = I + p_b: bidirectional __/ \\_ causal _/
    turns: (suffix + target + EOS) per turn; an `actions` sample: the chunk's H x A
    `bins` action ids instead (fixed length, no EOS), as the `ar` mode decodes them
`ids` holds the text part only (the image tokens come from the vision tower). A label at
text index j is the id the model must produce after text token j (-100: no loss)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embodied_kv.model.action_tokens import BinTokenizer, reserved_tail, text_ids
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
    patches: torch.Tensor  # [B, I] class id of each image token's patch (render.LABELS)
    kinds: list[str]
    ground: torch.Tensor | None = None  # [B, I] dataset.GROUND id of each image token's patch
    phases: list[str] | None = None  # the expert's phase at each sample's state
    centres: torch.Tensor | None = None  # [B, I, 2] table (x, y) each patch shows, NaN: none
    # the things the text names (the instruction's, the questions'): [M, 2] (sample, text
    # index of the name's last token) and [M, 2] their table (x, y) (train/names.py)
    names_at: torch.Tensor | None = None
    names_xy: torch.Tensor | None = None
    # [B] actions executed before each chunk (training-time RTC, Sample.held); None: off
    held: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to(self, device: torch.device) -> Batch:
        tensors = {k: v.to(device) for k, v in vars(self).items() if torch.is_tensor(v)}
        return Batch(**{**vars(self), **tensors})


def make_batch(samples: list[Sample], tokenizer, cfg: ModelConfig) -> Batch:
    """Tokenise like the engine: the prompt (model/prompt.py, truncated to
    max_text_tokens), then each turn's suffix without BOS, its target and EOS."""
    bins = None
    rows, prompt_lens, label_rows = [], [], []
    names_at: list[tuple[int, int]] = []
    names_xy: list[tuple[float, float]] = []

    def add_names(b: int, s: Sample, turn: int, ids: list[int], start: int) -> None:
        """The rows of the things `turn` names (-1: the instruction) in ids[start:]."""
        named = [(n, x, y) for i, n, x, y in s.names if i == turn]
        for at, (_, x, y) in zip(name_ends(ids, start, named, tokenizer), named, strict=True):
            names_at.append((b, at))
            names_xy.append((x, y))

    for b, s in enumerate(samples):
        state = np.zeros(cfg.state_dim)
        state[: min(cfg.state_dim, s.state.shape[0])] = s.state[: cfg.state_dim]
        prompt = tokenizer.encode(format_prompt(s.instruction, state, cfg.state_bins))
        ids = prompt[: cfg.max_text_tokens]
        prompt_lens.append(len(ids))
        add_names(b, s, -1, ids, 0)
        labels = [IGNORE] * len(ids)
        if s.kind == "actions":
            bins = bins or _bins(cfg)
            target = bins.encode(_padded_chunk(s.actions, cfg))
            labels[-1:] = target[:1]  # the prompt's last row predicts the first action id
            ids += target
            labels += target[1:] + [IGNORE]
        for turn, (suffix, text) in enumerate(s.turns):
            start = len(ids)
            ids += tokenizer.encode(suffix, bos=False) if suffix else []
            add_names(b, s, turn, ids, start)
            target = tokenizer.encode(text, bos=False) + [tokenizer.eos_id]
            labels += [IGNORE] * (len(ids) - len(labels))
            labels[-1] = target[0]  # the token whose logits give target[0]
            ids += target
            labels += target[1:] + [IGNORE]
        rows.append(ids)
        label_rows.append(labels)
    ids, labels = pad_rows(rows, label_rows, tokenizer.pad_id)
    actions = torch.stack([torch.from_numpy(_padded_chunk(s.actions, cfg)) for s in samples])
    return Batch(
        images=torch.from_numpy(np.stack([s.images for s in samples])),
        ids=ids,
        prompt_len=torch.tensor(prompt_lens),
        text_len=torch.tensor([len(r) for r in rows]),
        labels=labels,
        actions=actions.float(),
        patches=torch.from_numpy(np.stack([s.patches.reshape(-1) for s in samples])),
        kinds=[s.kind for s in samples],
        ground=torch.from_numpy(np.stack([s.ground.reshape(-1) for s in samples])),
        phases=[s.phase for s in samples],
        centres=torch.from_numpy(np.stack([s.centres.reshape(-1, 2) for s in samples])),
        names_at=torch.tensor(names_at, dtype=torch.long).reshape(-1, 2),
        names_xy=torch.tensor(names_xy, dtype=torch.float32).reshape(-1, 2),
        held=None if all(s.held is None for s in samples)
        else torch.tensor([s.held or 0 for s in samples]),
    )


def name_ends(ids: list[int], start: int, named, tokenizer) -> list[int]:
    """Text index of the last token of each name in `named` [(words, x, y)], searched in
    order in ids[start:] (a question names its things left to right, each after the
    previous one); ValueError if a name's tokens are not there."""
    out, pos = [], start
    for words, _, _ in named:
        want = tokenizer.encode(words, bos=False)
        at = next((i for i in range(pos, len(ids) - len(want) + 1)
                   if ids[i : i + len(want)] == want), None)  # fmt: skip
        if at is None:
            raise ValueError(f"the name {words!r} is not in the question's tokens")
        pos = at + len(want)
        out.append(pos - 1)
    return out


def pad_rows(rows: list[list[int]], label_rows: list[list[int]], pad_id: int):
    """Token rows and their label rows -> ids [B, T] pad-filled, labels [B, T]
    IGNORE-filled, T the longest row."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), t), IGNORE, dtype=torch.long)
    for b, (r, lab) in enumerate(zip(rows, label_rows, strict=True)):
        ids[b, : len(r)] = torch.tensor(r)
        labels[b, : len(lab)] = torch.tensor(lab)
    return ids, labels


def _padded_chunk(chunk: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """[H, a] expert chunk -> [H, A] zero-padded to the model's action_dim."""
    if chunk.shape[0] != cfg.action_horizon or chunk.shape[1] > cfg.action_dim:
        raise ValueError(f"sample chunk {chunk.shape} does not fit horizon "
                         f"{cfg.action_horizon} x action_dim {cfg.action_dim}")  # fmt: skip
    out = np.zeros((cfg.action_horizon, cfg.action_dim))
    out[:, : chunk.shape[1]] = chunk
    return out


def _bins(cfg: ModelConfig):
    """The `bins` action tokenizer over cfg's vocabulary (the `ar` mode's, horizon H)."""
    return BinTokenizer(cfg.vocab_size, cfg.action_horizon, cfg.action_dim,
                        reserved_tail(cfg), text_ids(cfg))  # fmt: skip
