"""The world's word-level tokenizer, built with `tokenizers` over the closed vocabulary
(world/vocab.py), saved as tokenizer.json and loaded by model/prompt.py's WordTokenizer."""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from embodied_kv.model.weights import atomic_path
from embodied_kv.world.vocab import vocabulary

SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")


def build_tokenizer() -> Tokenizer:
    """Ids: specials 0..3, then the vocabulary in world/vocab.py's fixed order. Whitespace
    pre-tokenisation splits words from punctuation ('200;' -> '200', ';')."""
    vocab = {w: i for i, w in enumerate([*SPECIALS, *vocabulary()])}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_tokenizer(path: str | Path) -> Path:
    """Write tokenizer.json atomically -> its path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        build_tokenizer().save(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the file ships beside the weights
    return path


def padded_vocab(n: int, multiple: int = 64) -> int:
    """The model's vocab_size for an n-id tokenizer (a multiple of 64 keeps matmuls aligned)."""
    return -(-n // multiple) * multiple
