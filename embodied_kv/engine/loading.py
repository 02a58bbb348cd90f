"""Building the engine's model from its config: the preset (grown for action ids in `ar`
mode), the tokenizer, and the weights file in the package's own layout or the public pi0.5 one.

The package's own layout carries its ModelConfig in the file's metadata, so an own-layout
file decides the model's shape: the preset only has to name the same model (a `tiny`
engine cannot load a `world` file), and the engine sizes its arena from the file's config.
The `world` preset's embedded default is the trained model the package ships
(`embodied_kv/data/world/`: weights.safetensors + tokenizer.json) when it is installed;
without it the preset runs on random weights with the world's word tokenizer."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from embodied_kv.model.action_tokens import action_model_config
from embodied_kv.model.checkpoint import load_pi05_checkpoint
from embodied_kv.model.config import ModelConfig, get_preset
from embodied_kv.model.robot_loader import find_tokenizer
from embodied_kv.model.trained import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    WORLD_PRESETS,
    config_from_json,
)
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import FORMAT, load_weights
from embodied_kv.model.word_tokenizer import save_tokenizer

if TYPE_CHECKING:
    from embodied_kv.engine.engine import EngineConfig

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
SHIPPED = {name: DATA_DIR / name / WEIGHTS_FILE for name in WORLD_PRESETS}  # preset -> weights


@dataclass(frozen=True)
class ModelSource:
    """What the engine builds: the model config, the weights ('' = random) and the
    tokenizer path (None = the config's tokenizer needs none or has none)."""

    cfg: ModelConfig
    weights: str
    tokenizer: str | None
    shipped: bool  # the weights are the package's own trained default

    @property
    def label(self) -> str:
        if not self.weights:
            return "random"
        return f"shipped {self.weights}" if self.shipped else self.weights


def shipped_weights(preset: str) -> Path | None:
    """The trained weights the package ships for `preset`, when installed."""
    path = SHIPPED.get(preset)
    return path if path is not None and path.is_file() else None


def own_layout_config(path: str | Path) -> ModelConfig | None:
    """The ModelConfig an own-layout file was saved with; None for any other file or dir."""
    p = Path(path)
    if not p.is_file():
        return None
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        return None
    return config_from_json(meta["config"])


def model_source(cfg: EngineConfig) -> ModelSource:
    """Resolve preset, weights and tokenizer; ValueError when an own-layout file was saved
    for another model than the preset names."""
    shipped = not cfg.weights and shipped_weights(cfg.preset) is not None
    weights = str(shipped_weights(cfg.preset)) if shipped else cfg.weights
    preset = get_preset(cfg.preset)
    saved = own_layout_config(weights) if weights else None
    if saved is not None and saved.name != preset.name:
        raise ValueError(
            f"weights {weights} were saved for preset {saved.name!r}, not {cfg.preset!r}: "
            f"set preset: {saved.name}"
        )
    model_cfg = saved or preset
    if cfg.action_mode == "ar":  # room for the action ids (tiny grows, pi05 / world have it)
        grown = action_model_config(model_cfg, cfg.ar.n_action_ids())
        if saved is not None and grown != saved:
            raise ValueError(
                f"weights {weights} have {saved.vocab_size} ids, too few for "
                f"{cfg.ar.n_action_ids()} {cfg.ar.kind} action ids above the text ids"
            )
        model_cfg = grown
    tokenizer = cfg.tokenizer or find_tokenizer(weights) or None
    if tokenizer is None and model_cfg.tokenizer == "words" and weights:
        beside = Path(weights).parent / TOKENIZER_FILE  # where `embodied-kv train` puts it
        if not beside.is_file():
            raise ValueError(f"{weights} needs its word tokenizer: {beside} does not exist")
        tokenizer = str(beside)
    return ModelSource(model_cfg, weights, tokenizer, shipped)


def load_model(cfg: EngineConfig, src: ModelSource | None = None):
    src = src or model_source(cfg)
    if src.tokenizer is None and src.cfg.tokenizer == "words":
        # random weights over the world's closed vocabulary: its tokenizer is the same
        # file whenever it is built, and is read once, when the model is built
        with tempfile.TemporaryDirectory() as tmp:
            tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
            model = build_model(src.cfg, cfg.device, tokenizer_path=str(tok))
    else:
        model = build_model(src.cfg, cfg.device, tokenizer_path=src.tokenizer)
    if src.weights:
        load_weights_file(model, src.weights)
    return model


def load_weights_file(model, path: str) -> None:
    """The package's own layout when the file says so, else the public pi0.5 layout."""
    if own_layout_config(path) is None:
        load_pi05_checkpoint(model, Path(path))
    else:
        load_weights(model, path)  # ValueError when saved for another config
