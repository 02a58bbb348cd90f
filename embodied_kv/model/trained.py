"""A trained model's files: weights (the package's own safetensors layout, whose metadata
holds the ModelConfig) and the word tokenizer beside them."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from embodied_kv.model.action_tokens import TEXT_IDS
from embodied_kv.model.config import GemmaConfig, ModelConfig, VisionConfig, get_preset
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import FORMAT, load_weights
from embodied_kv.model.word_tokenizer import build_tokenizer, padded_vocab

WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILE = "tokenizer.json"
WORLD_PRESETS = ("world", "world_smooth")  # presets built for the world's word tokenizer


def world_config(preset: str = "world", seed: int = 0) -> ModelConfig:
    """A preset with the world's word tokenizer: `world` and `world_smooth` as they are
    (their vocabulary holds the word ids and the 256 `bins` action ids above them), any
    other preset with a vocabulary that just fits the words (no room for action ids)."""
    n = build_tokenizer().get_vocab_size()
    if n > TEXT_IDS["words"]:
        raise ValueError(f"the world tokenizer has {n} ids > {TEXT_IDS['words']} reserved")
    if preset in WORLD_PRESETS:
        return get_preset(preset, seed=seed)
    return get_preset(preset, vocab_size=padded_vocab(n), tokenizer="words", seed=seed)


def config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    return ModelConfig(
        **{
            **d,
            "vision": VisionConfig(**d["vision"]),
            "backbone": GemmaConfig(**d["backbone"]),
            "expert": GemmaConfig(**d["expert"]),
        }
    )


def load_trained(weights: str | Path, tokenizer: str | Path | None = None, device: str = "cpu"):
    """Build the model a weights file was saved from and load it; the tokenizer defaults
    to tokenizer.json beside the weights."""
    weights = Path(weights)
    if not weights.is_file():
        raise ValueError(f"weights file {weights} does not exist")
    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{weights}: not an embodied_kv weights file ({meta.get('format')!r})")
    cfg = config_from_json(meta["config"])
    tok = tokenizer or (weights.parent / TOKENIZER_FILE if cfg.tokenizer == "words" else None)
    model = build_model(cfg, device, tokenizer_path=str(tok) if tok else None)
    load_weights(model, weights)
    return model
