"""FAST action tokens (openpi `FASTTokenizer` over HF `physical-intelligence/fast`'s
`UniversalActionProcessor`, processing_action_tokenizer.py), written here without scipy.

    chunk [H, A] --DCT-II over time (ortho)--> coeff [H, A]
    symbols = round(coeff * scale) - min_token, flattened row-major (frequency 0 of every
              dimension first: low frequencies first), each one character chr(symbol)
    fast ids = byte-level BPE (tokenizers) over that string     (upstream `__call__`)
    model ids = V - 1 - R - fast_id, then `|` and EOS            (openpi `tokenize`)

A frame's sequence ends at `|` / EOS, at the cap, or once its ids spell H * A symbols.
Decoding reverses it; a sequence that is not H * A symbols, holds an id outside the
FAST range or a symbol outside the trained alphabet decodes to zeros and is counted
(upstream: zeros on any exception; the alphabet check is ours: byte-level decoding of a
broken merge yields U+FFFD, which upstream would turn into a huge coefficient).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from embodied_kv.model.action_tokens import ActionTokenizer, TokenCounters

SCALE = 10.0  # upstream: scale
PROCESSOR_CONFIG = "processor_config.json"  # HF processor folder layout
TOKENIZER_JSON = "tokenizer.json"


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II [n, n]: X = C @ x (scipy.fft.dct(x, axis=0, norm="ortho"));
    its transpose is the inverse (DCT-III, idct norm="ortho")."""
    k = np.arange(n)[:, None]
    t = np.arange(n)[None, :]
    c = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * t + 1) * k / (2 * n))
    c[0] /= np.sqrt(2.0)
    return c


def dct(x: np.ndarray) -> np.ndarray:
    """DCT-II along axis 0 (time) of [H, A]."""
    return dct_matrix(x.shape[0]) @ x


def idct(x: np.ndarray) -> np.ndarray:
    return dct_matrix(x.shape[0]).T @ x


class FastTokenizer(ActionTokenizer):
    kind = "fast"

    def __init__(
        self,
        bpe,  # tokenizers.Tokenizer (byte-level BPE)
        vocab_size: int,  # model vocabulary V
        text_tokenizer,  # the model's: for the ids of `|` and EOS
        horizon: int,
        dims: int,
        min_token: int,
        alphabet: int,  # symbols 0..alphabet-1 are valid (max_token - min_token + 1)
        scale: float = SCALE,
        tail: int = 0,
        cap: int = 0,
    ):
        self.bpe, self.scale, self.min_token, self.alphabet = bpe, scale, min_token, alphabet
        self.fast_vocab = bpe.get_vocab_size()
        self.vocab_size, self.tail, self.text = vocab_size, tail, text_tokenizer
        # a text vocabulary smaller than the model's must stay clear of the FAST ids; one
        # that fills it (PaliGemma) gives its rarest ids up to them, as openpi does
        lowest = vocab_size - tail - self.fast_vocab
        if text_tokenizer.vocab_size < vocab_size and lowest < text_tokenizer.vocab_size:
            raise ValueError(
                f"{self.fast_vocab} FAST ids do not fit above {text_tokenizer.vocab_size} text "
                f"ids in a vocabulary of {vocab_size}"
            )
        self.bar_id = text_tokenizer.encode("|", bos=False)[-1]
        self.end_ids = (self.bar_id, text_tokenizer.eos_id)
        self.counters = TokenCounters()
        self.with_shape(horizon, dims, cap)

    def with_shape(self, horizon: int, dims: int, cap: int) -> FastTokenizer:
        if min(horizon, dims) < 1 or cap < 0:
            raise ValueError(
                f"FAST needs horizon, dims >= 1 and cap >= 0: {horizon}, {dims}, {cap}"
            )
        self.horizon, self.dims = horizon, dims
        self.max_tokens = cap or 2 * horizon * dims
        return self

    # -- the id mapping -------------------------------------------------------------------

    def swap(self, ids: list[int]) -> list[int]:
        """FAST ids <-> model ids (openpi: V - 1 - R - id; the map is its own inverse)."""
        return [self.vocab_size - 1 - self.tail - i for i in ids]

    def action_ids(self) -> torch.Tensor:
        top = self.vocab_size - self.tail
        fast = torch.arange(top - self.fast_vocab, top)
        return torch.cat([fast, torch.tensor(self.end_ids)])

    def is_end(self, tokens: list[int]) -> bool:
        """At `|` / EOS, at the cap, or as soon as the ids spell H * A symbols: then only
        `|` may follow, so the frame leaves a step earlier (openpi samples on to EOS)."""
        if super().is_end(tokens):
            return True
        fast = self.swap(tokens)
        if any(not 0 <= f < self.fast_vocab for f in fast):
            return False
        return len(self.bpe.decode(fast)) >= self.horizon * self.dims

    # -- encode / decode ------------------------------------------------------------------

    def symbols(self, chunk: np.ndarray) -> str:
        coeff = np.around(dct(self.check_chunk(chunk)) * self.scale)
        sym = np.maximum(coeff.reshape(-1) - self.min_token, 0).astype(int)  # upstream clamps
        return "".join(map(chr, sym))

    def encode(self, chunk: np.ndarray) -> list[int]:
        """[H, A] -> model ids of the action, then `|` and EOS (openpi's postfix)."""
        self.counters.encoded += 1
        fast = self.bpe.encode(self.symbols(chunk)).ids
        return self.swap(fast) + [self.bar_id, self.text.eos_id]

    def decode(self, ids: list[int]) -> tuple[np.ndarray, bool]:
        """Model ids (up to `|`/EOS, which may be absent) -> (chunk [H, A], valid)."""
        self.counters.decoded += 1
        body = []
        for i in ids:
            if i in self.end_ids:
                break
            body.append(i)
        fast = self.swap(body)
        if not body or any(not 0 <= f < self.fast_vocab for f in fast):
            return self.invalid()
        try:
            text = self.bpe.decode(fast)
        except Exception:  # noqa: BLE001 - upstream also maps any decode failure to zeros
            return self.invalid()
        sym = np.array([ord(c) for c in text], dtype=np.int64)
        if sym.shape != (self.horizon * self.dims,) or (sym >= self.alphabet).any():
            return self.invalid()
        coeff = (sym + self.min_token).reshape(self.horizon, self.dims) / self.scale
        return idct(coeff), True

    # -- training, saving, loading ----------------------------------------------------------

    @classmethod
    def train(
        cls,
        chunks: np.ndarray,  # [N, H, A] training action chunks in [-1, 1]
        vocab_size: int,
        text_tokenizer,
        fast_vocab: int = 1024,
        scale: float = SCALE,
        tail: int = 0,
        cap: int = 0,
    ) -> FastTokenizer:
        """Upstream `UniversalActionProcessor.fit`: BPE over the DCT symbol strings."""
        from tokenizers import ByteLevelBPETokenizer
        from tokenizers.trainers import BpeTrainer

        chunks = np.asarray(chunks, dtype=np.float64)
        if chunks.ndim != 3 or len(chunks) < 1:
            raise ValueError(f"training chunks must be [N, H, A], got {chunks.shape}")
        coeffs = np.around(np.stack([dct(c) for c in chunks]) * scale).reshape(len(chunks), -1)
        lo, hi = int(coeffs.min()), int(coeffs.max())
        if hi - lo > fast_vocab:
            raise ValueError(f"{hi - lo + 1} DCT symbols need fast_vocab >= {hi - lo}")
        strings = ("".join(map(chr, (row - lo).astype(int))) for row in coeffs)
        bpe = ByteLevelBPETokenizer()
        trainer = BpeTrainer(
            vocab_size=fast_vocab,
            min_frequency=2,
            show_progress=False,
            special_tokens=[],
            initial_alphabet=[chr(i) for i in range(hi - lo + 1)],
            max_token_length=10000,
        )
        bpe._tokenizer.train_from_iterator(strings, trainer=trainer)
        _, h, a = chunks.shape
        return cls(
            bpe._tokenizer, vocab_size, text_tokenizer, h, a, lo, hi - lo + 1, scale, tail, cap
        )

    def save(self, folder: str | Path) -> None:
        """The HF processor folder layout: tokenizer.json + processor_config.json."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.bpe.save(str(folder / TOKENIZER_JSON))
        config = {
            "processor_class": "UniversalActionProcessor",
            "scale": self.scale,
            "vocab_size": self.fast_vocab,
            "min_token": self.min_token,
            "alphabet": self.alphabet,
            "time_horizon": self.horizon,
            "action_dim": self.dims,
        }
        (folder / PROCESSOR_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(
        cls, folder: str | Path, vocab_size: int, text_tokenizer, tail: int = 0, cap: int = 0
    ) -> FastTokenizer:
        """A saved or downloaded FAST folder (HF `physical-intelligence/fast` layout; its
        `time_horizon` / `action_dim` may be null: `with_shape` sets them)."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        for name in (TOKENIZER_JSON, PROCESSOR_CONFIG):
            if not (folder / name).is_file():
                raise ValueError(f"FAST tokenizer folder {folder} has no {name}")
        cfg = json.loads((folder / PROCESSOR_CONFIG).read_text())
        bpe = Tokenizer.from_file(str(folder / TOKENIZER_JSON))
        # upstream keeps no alphabet size: every symbol the BPE can spell is then allowed
        alphabet = int(cfg.get("alphabet") or 0x110000)
        return cls(
            bpe,
            vocab_size,
            text_tokenizer,
            int(cfg.get("time_horizon") or 1),
            int(cfg.get("action_dim") or 1),
            int(cfg.get("min_token", 0)),
            alphabet,
            float(cfg.get("scale", SCALE)),
            tail,
            cap,
        )
