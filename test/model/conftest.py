from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from embodied_kv.model.config import get_preset
from embodied_kv.model.vla import build_model


@pytest.fixture(scope="session")
def tiny_model():
    return build_model(get_preset("tiny"))


class AllocationCounter(TorchDispatchMode):
    """Bytes of every new tensor storage created on a real device, by dtype.

    Counted at the dispatcher: an op's output whose storage is none of its inputs' is
    an allocation (views and in-place ops are not). Meta tensors cost nothing."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {ptr for ptr in _storage_ptrs((args, kwargs))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in known:
                    known.add(ptr)
                    self.bytes[t.dtype] += t.untyped_storage().nbytes()
        return out


def _storage_ptrs(tree):
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            yield t.untyped_storage().data_ptr()


@pytest.fixture
def count_allocations():
    return AllocationCounter
