import pytest

from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model

from ..kv.conftest import world_model  # noqa: F401  (the world preset, random weights)


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(get_preset("tiny"))
