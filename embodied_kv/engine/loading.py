"""Building the engine's model from its config: the preset (grown for action ids in `ar`
mode), the tokenizer, and the weights file in the package's own layout or the public pi0.5 one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from embodied_kv.model.action_tokens import action_model_config
from embodied_kv.model.checkpoint import load_pi05_checkpoint
from embodied_kv.model.config import get_preset
from embodied_kv.model.robot_loader import find_tokenizer
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import FORMAT, load_weights

if TYPE_CHECKING:
    from embodied_kv.engine.engine import EngineConfig


def load_model(cfg: EngineConfig):
    tokenizer = cfg.tokenizer or find_tokenizer(cfg.weights)
    model_cfg = get_preset(cfg.preset)
    if cfg.action_mode == "ar":  # room for the action ids (tiny grows, pi05 has it)
        model_cfg = action_model_config(model_cfg, cfg.ar.n_action_ids())
    model = build_model(model_cfg, cfg.device, tokenizer_path=tokenizer)
    if cfg.weights:
        load_weights_file(model, cfg.weights)
    return model


def load_weights_file(model, path: str) -> None:
    """The package's own layout when the file says so, else the public pi0.5 layout."""
    p = Path(path)
    if p.is_file():
        with safe_open(str(p), framework="pt") as f:
            if (f.metadata() or {}).get("format") == FORMAT:
                load_weights(model, p)
                return
    load_pi05_checkpoint(model, p)
