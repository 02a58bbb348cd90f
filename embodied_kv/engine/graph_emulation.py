"""CUDA-graph capture and replay without CUDA: the emulation behind GraphRunner(mode="emulate").

A CUDA graph records the kernels a function launches, with their arguments fixed:
device buffers by address, every host-side value (a Python int, a list, a host
tensor's contents) as it was at capture. A replay relaunches the same kernels over
whatever those buffers hold now. Reading a device value on the host during capture
(`int(t)`, `t.item()`, `t.tolist()`) is a sync, which a capture refuses.

`record` does the same one level up, on the CPU: it runs the function once under a
dispatch mode that records every tensor op (aten and custom ops such as the attention
kernel, which stays opaque as a kernel launch does) with its arguments. A tensor made
by an earlier recorded op becomes a reference to that op's output; any other tensor
(weights, the arena, the static inputs, a tensor built from host data) is kept as the
very same object, so a replay reads its current contents and writes it in place;
everything else is a constant. Reading a tensor's value on the host raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# aten ops that hand a tensor's value to the host, or whose output shape depends on
# values (so the host must read them): a sync, which CUDA graph capture refuses
HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
}
# and the Tensor methods that read values without dispatching an op
HOST_READ_METHODS = ("tolist", "numpy", "__array__")


@dataclass(frozen=True)
class _Out:
    op: int  # index of the recorded op
    leaf: int  # index of the tensor among that op's flattened outputs


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (func, args, kwargs) with _Out for produced tensors
        self._made: dict[int, _Out] = {}  # id(tensor) -> where it came from
        self._alive: list[torch.Tensor] = []  # keeps ids unique while recording
        self.in_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default)
        if func in HOST_READS or (bool_index and _has_bool_index(args[1])):
            _refuse(str(func))
        self.in_op += 1  # an op's own implementation (the attention kernel) may read
        try:
            out = func(*args, **kwargs)
        finally:
            self.in_op -= 1
        self.ops.append((func, *tree_map(self.ref, (args, kwargs))))
        leaves, _ = tree_flatten(out)
        for j, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and id(t) not in self._made:
                self._made[id(t)] = _Out(len(self.ops) - 1, j)
                self._alive.append(t)
        return out

    def ref(self, x):
        return self._made.get(id(x), x) if isinstance(x, torch.Tensor) else x


def record(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """Run fn once, recording it -> (replay, its output). replay() reruns the recorded ops
    and returns the new output tensor."""
    rec = _Recorder()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def guard(name):
        def method(self, *args, **kwargs):
            if not rec.in_op:
                _refuse(f"Tensor.{name}")
            return saved[name](self, *args, **kwargs)

        return method

    # Tensor.tolist and .numpy read memory without an op the mode would see: refuse them
    # while fn runs (restored right after; emulation is for tests, not a serving thread).
    try:
        for name in HOST_READ_METHODS:
            setattr(torch.Tensor, name, guard(name))
        with rec:
            out = fn()
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    ops, result = rec.ops, rec.ref(out)

    def resolve(x, values):
        return values[x.op][x.leaf] if isinstance(x, _Out) else x

    def replay() -> torch.Tensor:
        values: list[list] = []
        for func, args, kwargs in ops:
            args, kwargs = tree_map(lambda x: resolve(x, values), (args, kwargs))
            values.append(tree_flatten(func(*args, **kwargs))[0])
        return resolve(result, values)

    return replay, out


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _refuse(what: str) -> None:
    raise RuntimeError(
        f"{what} reads a tensor's value on the host inside a graph (a device sync, which "
        "CUDA graph capture refuses, and a value that replays would not update)"
    )
