import tempfile
from pathlib import Path

import pytest

from embodied_kv.model.vla import build_model
from embodied_kv.train.tokenizer import save_tokenizer
from embodied_kv.train.trained import TOKENIZER_FILE, world_config


@pytest.fixture(scope="session")
def world_model():
    """The `world` preset (word tokenizer) with random weights: structure, not skill."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = save_tokenizer(Path(tmp) / TOKENIZER_FILE)
        return build_model(world_config(), tokenizer_path=str(tok))
