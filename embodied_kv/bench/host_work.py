"""Host work of a region of real code, counted at the dispatcher: what makes a GPU design
host-bound, visible on a CPU before a GPU sees it.

    launches   aten ops that touch device memory and allocate or write (views are free);
               a CUDA graph's replay is one launch, whatever it holds
    h2d        host -> device copies (and their bytes): a host tensor that meets device
               memory (a copy into it, or an operand of an op on it)
    d2h        device -> host copies (`.to("cpu")`, a copy into a host tensor)
    syncs      the host waits for the device: `.item()` / `int(t)` / `bool(t)`, `.tolist()`,
               `.cpu()`, `.numpy()`, ops whose output shape is data (nonzero, masked_select,
               unique, a boolean index), `torch.equal`, a blocking device -> host copy,
               `torch.cuda.synchronize` and event / stream waits on the host

On CUDA a tensor's device says where it lives. On the CPU everything is host memory, so
placement is inferred by provenance ("emulation"): model parameters and buffers and the
arena's K/V are device memory (`seed`), and so is whatever an op makes from device
memory; a tensor built from Python data (`torch.tensor(list)`) is host memory, and so is
a copy made with `.to("cpu")` of device memory; a factory (zeros, arange, empty) takes
the side of the first tensor written into it or combined with it. Known limits: a
Triton kernel's CPU reference counts as its torch ops (an upper bound: one launch on
CUDA; on CUDA, Triton launches bypass the dispatcher and are not counted), and several
host tensors sent in one batched copy (`storage.step.to_device_as_one`) count as one
copy each on the CPU (an upper bound); a host tensor counts once per region, whatever
views of it cross (on CUDA, eager KEEP's layer-wise loading copies a range of its host
image per layer: there the CPU count is a lower bound).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from embodied_kv.engine import graph_emulation

aten = torch.ops.aten
DEVICE, HOST, NEUTRAL = "device", "host", "neutral"
SHAPE_FROM_DATA = {
    aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
    aten._unique2.default, aten.unique_dim.default, aten.equal.default,
    aten._local_scalar_dense.default,
}  # fmt: skip
FACTORIES = {
    aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.full.default,
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.empty_strided.default,
    aten.scalar_tensor.default, aten.randn.default, aten.rand.default,
}  # fmt: skip
HOST_READ_METHODS = ("tolist", "numpy", "cpu", "__array__")
REPLAY_CODE = next(c for c in graph_emulation.record.__code__.co_consts
                   if getattr(c, "co_name", "") == "replay")  # fmt: skip


@dataclass
class Count:
    launches: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    syncs: int = 0
    graph_replays: int = 0
    sites: dict = field(default_factory=dict)  # "syncs@file:line" / "h2d@..." -> count

    def as_dict(self) -> dict:
        return asdict(self)

    def per(self, n: int) -> dict:
        """Each field divided by n (per step, per plan)."""
        out = {k: v / n for k, v in asdict(self).items() if k != "sites"}
        return {**out, "sites": {k: v / n for k, v in self.sites.items()}}

    def add(self, what: str, k: int = 1, nbytes: int = 0) -> None:
        """k more of `what` (a field), noted at the package's line that caused them."""
        setattr(self, what, getattr(self, what) + k)
        if what == "h2d":
            self.h2d_bytes += nbytes
        if what in ("syncs", "h2d", "d2h"):
            site = f"{what}@{_site()}"
            self.sites[site] = self.sites.get(site, 0) + k


class HostWork(TorchDispatchMode):
    """`with hw.region("plan"):` counts into hw.counts["plan"]; enter `hw` itself (or use
    `count(...)`) to dispatch through it. `seed`: device tensors on a CPU run, `host`:
    host tensors made before the counter started (made inside, they are known)."""

    def __init__(self, seed: Iterable[torch.Tensor] = (), host: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.counts: dict[str, Count] = {}
        self._region: str | None = None
        self._side: dict[int, str] = {}  # storage ptr -> side (CPU emulation)
        self._sent: dict[int, torch.Tensor] = {}  # host storages sent this region
        self._replay_frame = None  # the emulated replay now running (one launch)
        self._cuda_run = torch.cuda.is_available()
        for t in seed:
            self.mark(t, DEVICE)
        for t in host:
            self.mark(t, HOST)

    def mark(self, t: torch.Tensor, side: str) -> None:
        if t.device.type == "cpu" and t.numel():
            self._side[t.untyped_storage().data_ptr()] = side

    def side(self, t: torch.Tensor) -> str:
        if t.device.type != "cpu":
            return DEVICE
        if self._cuda_run:  # a CUDA run: CPU memory is the host
            return HOST
        if not t.numel():
            return NEUTRAL
        return self._side.get(t.untyped_storage().data_ptr(), NEUTRAL)

    @contextmanager
    def region(self, name: str):
        old, self._region = self._region, name
        self.counts.setdefault(name, Count())
        self._sent = {}
        try:
            yield self.counts[name]
        finally:
            self._region = old
            self._sent = {}

    def __enter__(self):
        self._saved = {n: getattr(torch.Tensor, n) for n in HOST_READ_METHODS}
        for name in HOST_READ_METHODS:
            setattr(torch.Tensor, name, self._reader(name))
        self._cuda = {}
        if torch.cuda.is_available():
            owners = ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                      (torch.cuda.Stream, "synchronize"), (torch.cuda.CUDAGraph, "replay"))
            self._cuda = {(o, n): getattr(o, n) for o, n in owners}
            for (owner, name), fn in self._cuda.items():
                setattr(owner, name, self._wrapped(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, fn in self._saved.items():
                setattr(torch.Tensor, name, fn)
            for (owner, name), fn in self._cuda.items():
                setattr(owner, name, fn)

    def _count(self) -> Count | None:
        return self.counts[self._region] if self._region is not None else None

    def _reader(self, name: str):
        saved = self._saved[name]

        def method(t, *args, **kwargs):  # on CUDA the copy to the host is an op: seen there
            c = self._count()
            if c is not None and not self._cuda_run and self.side(t) == DEVICE and (
                not self._in_replay()
            ):
                c.add("syncs")
                c.add("d2h")
            return saved(t, *args, **kwargs)

        return method

    def _wrapped(self, name: str, fn):
        def call(*args, **kwargs):
            c = self._count()
            if c is not None:
                if name == "replay":
                    c.launches += 1
                    c.graph_replays += 1
                else:
                    c.add("syncs")
            return fn(*args, **kwargs)

        return call

    def _in_replay(self) -> bool:
        """Inside an emulated graph's replay: its ops are one launch, counted once."""
        f = sys._getframe(2)
        while f is not None:
            if f.f_code is REPLAY_CODE:
                if f is not self._replay_frame:
                    self._replay_frame = f
                    c = self._count()
                    if c is not None:
                        c.launches += 1
                        c.graph_replays += 1
                return True
            f = f.f_back
        self._replay_frame = None
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_replay():  # a graph's work happens on the device
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark(t, DEVICE)
            return out
        if self._region is None:
            return out
        c = self.counts[self._region]
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        sides = [self.side(t) for t in ins]
        on_device = DEVICE in sides
        if func in SHAPE_FROM_DATA or _bool_index(func, args):
            if on_device:
                c.add("syncs")
                c.launches += int(func is not aten._local_scalar_dense.default)
            for t in outs:
                self.mark(t, HOST if func is aten._local_scalar_dense.default else sides[0])
            return out
        if func in FACTORIES or func is aten.lift_fresh.default or not ins:
            side = HOST if func is aten.lift_fresh.default else NEUTRAL
            for t in outs:
                self.mark(t, side)
            return out
        if func is aten._to_copy.default and "device" in kwargs and on_device:
            if torch.device(kwargs["device"]).type == "cpu":  # .to("cpu"): a blocking copy
                c.add("d2h")
                c.add("syncs")
                for t in outs:
                    self.mark(t, HOST)
                return out
        if func is aten.copy_.default:
            dst, src = sides[0], sides[1]
            if dst == HOST and src == DEVICE:
                c.add("d2h")
                c.add("syncs", int(not (len(args) > 2 and args[2])))  # non_blocking: no wait
                return out
            if dst == NEUTRAL:
                self.mark(args[0], src)
                if src != DEVICE:
                    return out
        fresh = [t for t in outs if not any(_same(t, i) for i in ins)]
        if not (func._schema.is_mutable or fresh):
            return out  # a view
        written = [t for t in outs if any(t is f for f in fresh) is False]  # out= / in place
        if on_device or any(self.side(t) == DEVICE for t in written):
            c.launches += 1
            for t, s in zip(ins, sides, strict=True):
                if s == HOST and t.dim() > 0:
                    key = t.untyped_storage().data_ptr()
                    if key not in self._sent:  # held: its address is not reused meanwhile
                        self._sent[key] = t
                        c.add("h2d", 1, t.numel() * t.element_size())
            side = DEVICE
        else:
            side = HOST if HOST in sides else NEUTRAL
        for t in fresh:
            self.mark(t, side)
        if func._schema.is_mutable and ins and side == DEVICE and sides[0] == NEUTRAL:
            self.mark(ins[0], DEVICE)  # a host tensor stays host: on a CPU run its
            # "device copy" (storage.step.to_device: a no-op there) is the same storage
        return out


def _site() -> str:
    """file:line of the innermost frame of this package outside this module."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "embodied_kv" in name and not name.endswith("host_work.py"):
            return f"{name.split('embodied_kv/')[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bool_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


def model_seed(model, arena=None) -> list[torch.Tensor]:
    """The tensors a CPU run treats as device memory: weights, buffers, the arena's KV."""
    seed = [*model.parameters(), *model.buffers()]
    return seed + ([arena.k, arena.v] if arena is not None else [])


def arena_host(arena) -> list[torch.Tensor]:
    """The arena's host-side bookkeeping (row counts, positions): host memory by design."""
    return [arena.length, arena.next_pos]


def count(fn, seed: Iterable[torch.Tensor] = (), host: Iterable[torch.Tensor] = (),
          repeats: int = 1) -> dict:  # fmt: skip
    """fn() run `repeats` times under a fresh counter -> the counts per call."""
    hw = HostWork(seed, host)
    with hw, hw.region("call") as c:
        for _ in range(repeats):
            fn()
    return c.per(repeats)
