"""What a region of the real code would launch on a GPU: kernels, FLOPs, bytes moved.

Recorded at the dispatcher (CPU tensors, any dtype), so it counts the ops the code
really issues, not a hand count:

    kernel   an aten op that allocates or writes memory; views cost nothing
    FLOPs    torch's own flop registry (matmuls, convolutions, sdpa)
    bytes    tensors read + written by the kernel; gathers count the rows they touch,
             in-place writes the data they write (not the whole destination)
    syncs    device -> host reads (`.item()`, `int(t)`): each stalls the GPU queue

The CPU reference of packed attention is many torch ops; on CUDA it is one Triton
kernel, so `census.single_kernel(...)` records such a call as one kernel with its
FLOPs and bytes given by the caller.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
GATHERS = {aten.index.Tensor, aten.embedding.default, aten.index_select.default}
SYNCS = {aten._local_scalar_dense.default}


@dataclass
class Tally:
    kernels: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    syncs: int = 0
    ideal_s: float = 0.0  # sum over kernels of max(FLOPs / peak, bytes / bandwidth)
    busy_s: float = 0.0  # the same at the achievable fractions of peak and bandwidth

    def __add__(self, o: Tally) -> Tally:
        return Tally(*(a + b for a, b in zip(self.astuple(), o.astuple(), strict=True)))

    def __sub__(self, o: Tally) -> Tally:
        return Tally(*(a - b for a, b in zip(self.astuple(), o.astuple(), strict=True)))

    def __mul__(self, k: float) -> Tally:
        return Tally(*(a * k for a in self.astuple()))

    def astuple(self) -> tuple:
        return (self.kernels, self.flops, self.bytes, self.syncs, self.ideal_s, self.busy_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Roofline:
    """A GPU as two numbers and what fraction of each a real kernel reaches."""

    flops_per_s: float  # dense bf16 tensor-core peak
    bytes_per_s: float  # HBM bandwidth
    fp32_flops_per_s: float  # fp32 GEMMs (torch keeps TF32 off for matmuls by default)
    compute_eff: float = 1.0
    memory_eff: float = 1.0
    step_latency_s: float = 0.0  # one dependent step of a kernel's loop (load, MMA, softmax)

    def seconds(
        self, flops: float, nbytes: float, fp32: bool = False, ideal: bool = False,
        serial_steps: int = 0,
    ) -> float:  # fmt: skip
        """A kernel is bound by compute or by memory, never by their sum, or (not ideal) by
        the latency of its longest program's chain of `serial_steps` loop steps: a grid
        that leaves most SMs idle runs as long as its longest program."""
        ce, me = (1.0, 1.0) if ideal else (self.compute_eff, self.memory_eff)
        peak = self.fp32_flops_per_s if fp32 else self.flops_per_s
        chain = 0.0 if ideal else serial_steps * self.step_latency_s
        return max(flops / (ce * peak), nbytes / (me * self.bytes_per_s), chain)


class Census(TorchDispatchMode):
    """Per-region tallies of the ops run inside `with census.region(name)`, each kernel
    priced on `gpu` as it is recorded."""

    def __init__(self, gpu: Roofline):
        super().__init__()
        self.gpu = gpu
        self.tallies: dict[str, Tally] = {}
        self.by_op: dict[tuple[str, str], Tally] = {}  # (region, aten op) -> its share
        self._region: str | None = None
        self._muted = False

    @contextmanager
    def region(self, name: str):
        old, self._region = self._region, name
        self.tallies.setdefault(name, Tally())
        try:
            yield
        finally:
            self._region = old

    @contextmanager
    def single_kernel(self, cost):
        """Ops inside are one GPU kernel (a fused / Triton kernel); `cost()` -> (FLOPs,
        bytes) or (FLOPs, bytes, serial loop steps of its longest program), evaluated
        unrecorded after the block, or a list of them where the fused op is a fixed
        sequence of kernels (split partials, then their reduce). Inside another single
        kernel it is part of that one (a persistent kernel's phases): not recorded."""
        old, self._muted = self._muted, True
        try:
            yield
            costs = [] if old else cost()
        finally:
            self._muted = old
        for c in costs if isinstance(costs, list) else [costs]:
            self._add("single_kernel", c[0], c[1], serial_steps=c[2] if len(c) > 2 else 0)

    def _add(
        self, op: str, flops: float, nbytes: float, syncs: int = 0, fp32: bool = False,
        serial_steps: int = 0,
    ) -> None:  # fmt: skip
        if self._region is None:
            return
        for t in (self.tallies[self._region], self.by_op.setdefault((self._region, op), Tally())):
            if syncs:
                t.syncs += syncs
                continue
            t.kernels += 1
            t.flops += flops
            t.bytes += nbytes
            t.ideal_s += self.gpu.seconds(flops, nbytes, fp32, ideal=True)
            t.busy_s += self.gpu.seconds(flops, nbytes, fp32, serial_steps=serial_steps)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._muted or self._region is None:
            return out
        if func in SYNCS:
            self._add(str(func), 0, 0, syncs=1)
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_ptrs = {t.untyped_storage().data_ptr() for t in ins}
        fresh = [t for t in outs if t.untyped_storage().data_ptr() not in in_ptrs]
        mutable = func._schema.is_mutable
        if not (mutable or fresh):
            return out  # a view
        if func in GATHERS:
            nbytes = 2 * sum(map(_nbytes, fresh)) + sum(_nbytes(t) for t in ins[1:])
        elif mutable:
            others = ins[1:]
            nbytes = 2 * sum(map(_nbytes, others)) if others else _nbytes(ins[0])
        else:
            nbytes = sum(map(_nbytes, ins)) + sum(map(_nbytes, fresh))
        count = flop_registry.get(func.overloadpacket)
        flops = count(*args, **kwargs, out_val=out) if count is not None else 0
        fp32 = bool(flops) and ins[0].dtype == torch.float32
        self._add(str(func), float(flops), float(nbytes), fp32=fp32)
        return out
