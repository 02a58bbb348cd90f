"""Tokenizers and the pi0.5 prompt (task + discretised state)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; needs no download (the `tiny` preset). Bytes that are
    not UTF-8 decode as `\\xNN` escapes, so random-weight output stays readable ASCII."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="backslashreplace")


class GemmaTokenizer:
    """PaliGemma's SentencePiece tokenizer, from a user-given file or directory."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        path = Path(path)
        if not path.exists():
            raise ValueError(f"tokenizer path {path} does not exist")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class WordTokenizer:
    """A word-level `tokenizers` file (model/word_tokenizer.py builds one over the world's
    closed vocabulary): words and punctuation are ids, whitespace is not kept, so
    decode joins words with single spaces."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"word tokenizer file {path} does not exist")
        self._tok = Tokenizer.from_file(str(path))
        ids = {t: self._tok.token_to_id(t) for t in ("[BOS]", "[EOS]", "[PAD]")}
        if None in ids.values():
            raise ValueError(f"{path}: needs [BOS], [EOS] and [PAD] tokens, has {ids}")
        self.bos_id, self.eos_id, self.pad_id = ids["[BOS]"], ids["[EOS]"], ids["[PAD]"]
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def make_tokenizer(kind: str, path: str | Path | None = None):
    """`gemma` without a path falls back to bytes (random-weight speed runs of pi05:
    the ids are valid, the text is not language) and says so."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "gemma":
        if path is None:
            warnings.warn(
                "no tokenizer path for the gemma tokenizer: using byte ids (fine for random "
                "weights; give the PaliGemma tokenizer for a real checkpoint)",
                stacklevel=2,
            )
            return ByteTokenizer()
        return GemmaTokenizer(path)
    if kind == "words":
        if path is None:
            raise ValueError("the words tokenizer needs its tokenizer.json path")
        return WordTokenizer(path)
    raise ValueError(f"unknown tokenizer {kind!r}; use 'bytes', 'gemma' or 'words'")


def discretize_state(state: np.ndarray, bins: int = 256) -> np.ndarray:
    """Normalised state -> bin ids, as openpi `PaligemmaTokenizer.tokenize` and LeRobot
    `Pi05PrepareStateTokenizerProcessorStep`: np.digitize over linspace(-1, 1, bins + 1)[:-1]
    minus 1, no clip: a value below -1 is bin -1, a value above 1 is bins - 1."""
    edges = np.linspace(-1.0, 1.0, bins + 1)[:-1]
    return np.digitize(np.asarray(state), edges) - 1


def clean_task(task: str) -> str:
    return task.strip().replace("_", " ").replace("\n", " ")


def format_prompt(task: str, state: np.ndarray, bins: int = 256) -> str:
    """The pi0.5 prompt: `Task: <task>, State: <s0 s1 ...>;\\nAction: `."""
    state_str = " ".join(str(int(b)) for b in discretize_state(state, bins))
    return f"Task: {clean_task(task)}, State: {state_str};\nAction: "


@dataclass(frozen=True)
class PromptTokens:
    ids: list[int]
    truncated: bool  # the prompt was longer than max_text_tokens and was cut


def tokenize_prompt(tokenizer, task: str, state: np.ndarray, max_tokens: int, bins: int = 256):
    ids = tokenizer.encode(format_prompt(task, state, bins), bos=True)
    return PromptTokens(ids=ids[:max_tokens], truncated=len(ids) > max_tokens)
