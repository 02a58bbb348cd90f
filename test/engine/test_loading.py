"""engine/loading.py: an own-layout weights file decides the model's config, a preset
that names another model is refused, and the `world` preset's embedded default is the
package's shipped model when it is installed (else random weights, word tokenizer)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from embodied_kv.engine import loading
from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.model.action_tokens import ActionTokenConfig
from embodied_kv.model.trained import TOKENIZER_FILE, WEIGHTS_FILE, world_config
from embodied_kv.model.vla import build_model
from embodied_kv.model.weights import save_weights
from embodied_kv.model.word_tokenizer import save_tokenizer


def saved_world(folder, seed=7, **overrides):
    """A random `world` model saved as `embodied-kv train` saves one -> (path, model)."""
    folder.mkdir(parents=True)
    tok = save_tokenizer(folder / TOKENIZER_FILE)
    model = build_model(replace(world_config(seed=seed), **overrides), tokenizer_path=str(tok))
    save_weights(model, folder / WEIGHTS_FILE)
    return folder / WEIGHTS_FILE, model


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_own_layout_file_gives_the_config_and_the_preset_must_name_it(tmp_path):
    # a config the preset does not have (another text length): taken from the file
    path, model = saved_world(tmp_path / "w", max_text_tokens=64)
    engine = Engine(EngineConfig(preset="world", weights=str(path), cuda_graphs=False))
    assert engine.model.cfg == model.cfg and engine.model.cfg.max_text_tokens == 64
    assert same_weights(engine.model, model) and not engine.source.shipped
    assert engine.model.tokenizer.encode("the red box") == model.tokenizer.encode("the red box")
    with pytest.raises(ValueError, match=r"saved for preset 'world', not 'tiny': set preset"):
        Engine(EngineConfig(preset="tiny", weights=str(path)))
    (tmp_path / "w" / TOKENIZER_FILE).unlink()
    with pytest.raises(ValueError, match="needs its word tokenizer"):
        Engine(EngineConfig(preset="world", weights=str(path)))


def test_world_default_is_the_shipped_model_else_random(tmp_path, monkeypatch):
    monkeypatch.setitem(loading.SHIPPED, "world", tmp_path / "absent" / WEIGHTS_FILE)
    random = Engine(EngineConfig(preset="world", cuda_graphs=False))
    assert random.source.weights == "" and not random.source.shipped
    assert same_weights(random.model, build_model(world_config(), tokenizer_path=str(
        save_tokenizer(tmp_path / TOKENIZER_FILE))))  # fmt: skip
    path, model = saved_world(tmp_path / "data" / "world")
    monkeypatch.setitem(loading.SHIPPED, "world", path)
    engine = Engine(EngineConfig(preset="world", cuda_graphs=False))
    assert engine.source.shipped and engine.source.weights == str(path)
    assert same_weights(engine.model, model)
    tiny = Engine(EngineConfig(preset="tiny", cuda_graphs=False))  # no shipped tiny model
    assert tiny.source.weights == "" and tiny.model.cfg.name == "tiny"


def test_ar_mode_keeps_the_files_vocabulary_or_says_it_is_too_small(tmp_path):
    path, model = saved_world(tmp_path / "w")
    bins = ActionTokenConfig(kind="bins", horizon=2)
    cfg = EngineConfig(preset="world", weights=str(path), action_mode="ar", ar=bins,
                       num_slots=2 * 8 + 2, cuda_graphs=False)  # fmt: skip
    assert loading.model_source(cfg).cfg == model.cfg  # 640 ids hold the 256 bins
    fast = replace(cfg, ar=ActionTokenConfig(kind="fast", horizon=2, fast_vocab=1024))
    with pytest.raises(ValueError, match="too few for 1024 fast action ids"):
        loading.model_source(fast)
