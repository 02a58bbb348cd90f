"""Autoregressive action tokens for the backbone: one interface, two tokenisers.

    encode(chunk [H, A] in [-1, 1]) -> model vocabulary ids (what the backbone emits)
    decode(ids)                     -> (chunk [H, A], valid); invalid -> zeros, counted

Where the ids sit in the model vocabulary (V = cfg.vocab_size, R = reserved tail):

    [0 ........ text ids ........ | ... | action ids | R reserved ids ]  V
                                         V-R-n .. V-R-1

* `bins` (OpenVLA `ActionTokenizer`): each value clipped to [-1, 1] and digitised
  against 256 edges, bin = np.digitize in 1..256, id = V - R - bin (OpenVLA:
  `tokenizer.vocab_size - bin`); decode = the 255 bin centres. Fixed length H * A.
* `fast` (openpi `FASTTokenizer`, model/fast_tokenizer.py): id = V - 1 - R - fast_id
  (openpi `_act_tokens_to_paligemma_tokens`), then `|` and EOS end the action.

R is PaliGemma's 128 special ids at the top of its vocabulary (openpi
`fast_skip_tokens = 128`) with the `gemma` text tokenizer, 0 with `bytes` and `words`
(no special tail). The action ids must lie above every text id (`TEXT_IDS`: 259 byte
ids; the world's word tokenizer stays below 384). The `tiny` preset's vocabulary is too
small for 256 or 1024 action ids above them: `action_model_config` grows it through the
preset overrides (only in `ar` mode, so `flow` keeps its weights); the `world` preset was
trained with room for the 256 bins; PaliGemma's 257,152 ids hold them by reusing its
rarest tokens, as openpi does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from embodied_kv.model.config import ModelConfig
from embodied_kv.model.prompt import ByteTokenizer

BINS = 256  # OpenVLA: n_bins
PALIGEMMA_SPECIAL_TAIL = 128  # openpi: fast_skip_tokens
VOCAB_ROUND = 64  # a grown vocabulary is rounded up to this
# ids the text tokenizer may emit, per ModelConfig.tokenizer (gemma: its vocabulary is
# the model's, and the action ids reuse its top as openpi does)
TEXT_IDS = {"bytes": ByteTokenizer.vocab_size, "words": 384, "gemma": 0}


def reserved_tail(cfg: ModelConfig) -> int:
    return PALIGEMMA_SPECIAL_TAIL if cfg.tokenizer == "gemma" else 0


def text_ids(cfg: ModelConfig) -> int:
    if cfg.tokenizer not in TEXT_IDS:
        raise ValueError(f"unknown tokenizer {cfg.tokenizer!r}; known {sorted(TEXT_IDS)}")
    return TEXT_IDS[cfg.tokenizer]


def action_model_config(cfg: ModelConfig, n_action_ids: int) -> ModelConfig:
    """`cfg` with a vocabulary large enough for `n_action_ids` above the text ids and
    below the reserved tail; unchanged when it already is (pi05, world with bins)."""
    need = text_ids(cfg) + n_action_ids + reserved_tail(cfg)
    if cfg.vocab_size >= need:
        return cfg
    return replace(cfg, vocab_size=-(-need // VOCAB_ROUND) * VOCAB_ROUND)


@dataclass
class TokenCounters:
    encoded: int = 0
    decoded: int = 0
    invalid: int = 0  # decodes that returned zeros


class ActionTokenizer:
    """The interface the pipeline uses; subclasses fill in the id mapping."""

    kind = ""
    horizon: int  # H: timesteps of one decoded action chunk
    dims: int  # A: action dimensions
    max_tokens: int  # cap on ids generated per frame (ActionFlow's K)
    end_ids: tuple[int, ...] = ()  # ids that end a frame's sequence early
    counters: TokenCounters

    def action_ids(self) -> torch.Tensor:
        """Every id decoding may emit [n] int64: constrained greedy picks among these."""
        raise NotImplementedError

    def encode(self, chunk: np.ndarray) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> tuple[np.ndarray, bool]:
        raise NotImplementedError

    def check_chunk(self, chunk: np.ndarray) -> np.ndarray:
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.shape != (self.horizon, self.dims):
            raise ValueError(f"chunk {chunk.shape} != ({self.horizon}, {self.dims})")
        return chunk

    def invalid(self) -> tuple[np.ndarray, bool]:
        self.counters.invalid += 1
        return np.zeros((self.horizon, self.dims)), False

    def is_end(self, tokens: list[int]) -> bool:
        """Does the frame leave the pipeline after these tokens (end id or cap)?"""
        return len(tokens) >= self.max_tokens or (bool(tokens) and tokens[-1] in self.end_ids)


class BinTokenizer(ActionTokenizer):
    """OpenVLA's uniform bins (prismatic/vla/action_tokenizer.py `ActionTokenizer`)."""

    kind = "bins"

    def __init__(
        self, vocab_size: int, horizon: int, dims: int, tail: int = 0, text: int | None = None
    ):
        text = ByteTokenizer.vocab_size if text is None else text  # ids text may use
        if min(horizon, dims) < 1 or vocab_size - tail - BINS < text:
            raise ValueError(
                f"bins need horizon, dims >= 1 and {BINS} ids above the {text} text ids: "
                f"horizon={horizon} dims={dims} vocab={vocab_size} tail={tail}"
            )
        self.vocab_size, self.tail = vocab_size, tail
        self.horizon, self.dims = horizon, dims
        self.max_tokens = horizon * dims
        self.edges = np.linspace(-1.0, 1.0, BINS)  # OpenVLA: self.bins
        self.centres = (self.edges[:-1] + self.edges[1:]) / 2.0  # OpenVLA: bin_centers
        self.counters = TokenCounters()

    def action_ids(self) -> torch.Tensor:
        top = self.vocab_size - self.tail
        return torch.arange(top - BINS, top)

    def encode(self, chunk: np.ndarray) -> list[int]:
        """[H, A] -> H * A ids, time-major (all dims of step 0 first, as OpenVLA's one step)."""
        x = np.clip(self.check_chunk(chunk), -1.0, 1.0).reshape(-1)
        self.counters.encoded += 1
        return (self.vocab_size - self.tail - np.digitize(x, self.edges)).tolist()

    def decode(self, ids: list[int]) -> tuple[np.ndarray, bool]:
        self.counters.decoded += 1
        ids = np.asarray(ids, dtype=np.int64)
        b = self.vocab_size - self.tail - ids  # 1..256 when valid
        if ids.shape != (self.max_tokens,) or (b < 1).any() or (b > BINS).any():
            return self.invalid()
        # OpenVLA: clip(bin - 1, 0, 254) -> bin_centers (bin 256 is value 1.0 itself)
        centres = self.centres[np.clip(b - 1, 0, self.centres.shape[0] - 1)]
        return centres.reshape(self.horizon, self.dims), True


@dataclass(frozen=True)
class ActionTokenConfig:
    kind: str = "bins"  # bins | fast
    horizon: int = 1  # timesteps per decoded chunk (bins: K = horizon * dims)
    max_tokens: int = 0  # fast: cap per frame (ActionFlow's K); 0 = 2 * horizon * dims
    fast_dir: str = ""  # fast: a saved tokenizer folder (tokenizer.json + processor_config)
    fast_vocab: int = 1024  # fast: BPE vocabulary when one is trained here (openpi: 1024)
    fast_train_chunks: int = 2000  # fast: synthetic smooth chunks the BPE is trained on
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("bins", "fast"):
            raise ValueError(f"action tokenizer {self.kind!r}: use 'bins' or 'fast'")
        if self.horizon < 1 or self.max_tokens < 0 or self.fast_vocab < 2:
            raise ValueError(f"bad action token config: {self}")

    def n_action_ids(self) -> int:
        return BINS if self.kind == "bins" else self.fast_vocab


def make_action_tokenizer(cfg: ActionTokenConfig, model_cfg: ModelConfig, text_tokenizer):
    """The tokenizer over `model_cfg`'s vocabulary (already grown by action_model_config)."""
    tail, dims = reserved_tail(model_cfg), model_cfg.action_dim
    if cfg.kind == "bins":
        return BinTokenizer(model_cfg.vocab_size, cfg.horizon, dims, tail, text_ids(model_cfg))
    from embodied_kv.model.fast_tokenizer import FastTokenizer

    cap = cfg.max_tokens or 2 * cfg.horizon * dims
    if cfg.fast_dir:
        fast = FastTokenizer.load(cfg.fast_dir, model_cfg.vocab_size, text_tokenizer, tail)
        fast = fast.with_shape(cfg.horizon, dims, cap)
    else:
        chunks = smooth_chunks(cfg.fast_train_chunks, cfg.horizon, dims, cfg.seed)
        fast = FastTokenizer.train(
            chunks, model_cfg.vocab_size, text_tokenizer, cfg.fast_vocab, tail=tail, cap=cap
        )
    return fast


def smooth_chunks(n: int, horizon: int, dims: int, seed: int = 0) -> np.ndarray:
    """[n, H, A] smooth trajectories in [-1, 1]: a few low-frequency cosines per dimension
    plus an offset (what robot action chunks look like to a DCT)."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0.0, 1.0, horizon)[None, :, None]  # [1, H, 1]
    out = rng.uniform(-0.5, 0.5, (n, 1, dims))
    for k in range(1, 4):
        amp = rng.uniform(-0.3, 0.3, (n, 1, dims)) / k
        phase = rng.uniform(0, np.pi, (n, 1, dims))
        out = out + amp * np.cos(np.pi * k * t + phase)
    return np.clip(out, -1.0, 1.0)
