import pytest

from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(get_preset("tiny"))
