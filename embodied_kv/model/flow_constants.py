"""Per-weights constants of the action expert: the adaRMS modulation of the Euler steps'
flow times, computed once per weights load instead of on every action.

The flow times t_k = 1 + k dt depend only on the number of steps, and every norm's
modulation only on t_k and the weights (time MLP, each norm's dense layer): at pi05 that
is 39 fp32 GEMMs (~0.54 ms on an H100) that every action recomputed with the same result.

    key    (steps, dtype, device)         one table per schedule the engine runs; steps
                                          CLEAN (0): t = 0 alone, the held rows of
                                          training-time RTC (model/rtc_prefix.py)
    stamp  (data_ptr, _version) of every tensor the modulation reads: an in-place load
           (`copy_` into a parameter: model/weights.py, checkpoint.py), an optimizer step
           or a replaced / moved parameter (precision.py's `p.data = ...`) changes it

A stale table is recomputed into the same tensors (`copy_`), so a CUDA graph that read it
at capture (engine/graphs.py) reads the new values at its next replay; the runner calls
`refresh` on the host before each replay (a host-side comparison, no device sync). The
cached tensors are what `ActionExpert.modulation` returns for the same times: the same
ops on the same shapes, so the same bytes (test/model/test_flow_constants.py).

Not cached (computed as before): with autograd on (training needs the gradient through
the time MLP) and inside torch.compile's trace (no data_ptr there).
"""

from __future__ import annotations

import torch

CLEAN = 0  # the table of flow time 0 alone: training-time RTC's held rows (rtc_prefix.py)


def step_times(steps: int, device) -> torch.Tensor:
    """t_k = 1 + k dt in float64, as the Python float would be, then fp32 [steps]."""
    dt = -1.0 / steps
    return (1.0 + torch.arange(steps, dtype=torch.float64, device=device) * dt).float()


def table_times(steps: int, device) -> torch.Tensor:
    """The flow times of table `steps`: the Euler steps' (`step_times`), or t = 0 alone
    (`CLEAN`)."""
    if steps == CLEAN:
        return torch.zeros(1, device=device)
    return step_times(steps, device)


class FlowModulationCache:
    """(steps, dtype, device) -> the expert's Modulation of those steps' flow times."""

    def __init__(self):
        self._tables: dict[tuple, tuple[tuple, object]] = {}  # key -> (stamp, Modulation)
        self.computed = 0  # tables computed or refreshed (tests, benches)

    @staticmethod
    def usable() -> bool:
        return not torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def get(self, expert, steps: int, device):
        """The modulation of `steps` flow times on `device`, current with the weights;
        computed fresh (not kept) where caching is off (see the module docstring)."""
        device = torch.device(device)
        if not self.usable():
            return expert.modulation(table_times(steps, device))
        return self.refresh(expert, steps, device)

    def refresh(self, expert, steps: int, device):
        """Recompute the table of (steps, device) in place if the weights changed (or make
        it) -> the table. Host-side check only while the weights are unchanged."""
        device = torch.device(device)
        key = (steps, expert.dtype, device)
        stamp = weights_stamp(expert)
        entry = self._tables.get(key)
        if entry is not None and entry[0] == stamp:
            return entry[1]
        fresh = expert.modulation(table_times(steps, device))
        self.computed += 1
        if entry is None:
            self._tables[key] = (stamp, fresh)
            return fresh
        table = entry[1]
        for name in ("scale1", "shift", "gate"):  # same addresses: graphs see the new values
            getattr(table, name).copy_(getattr(fresh, name))
        self._tables[key] = (stamp, table)
        return table

    def refresh_all(self, expert) -> None:
        """Bring every kept table up to date with the weights (before a graph replay)."""
        for steps, _dtype, device in list(self._tables):
            self.refresh(expert, steps, device)

    def clear(self) -> None:
        self._tables.clear()


def weights_stamp(expert) -> tuple:
    """(data_ptr, version) of every tensor the modulation reads; changes with any in-place
    write to one of them or a replaced one. A view shares its base's version counter."""
    tensors = [expert.time_mlp_in.weight, expert.time_mlp_in.bias,
               expert.time_mlp_out.weight, expert.time_mlp_out.bias]  # fmt: skip
    for norm in expert.norms():
        tensors += [norm.dense.weight, norm.dense.bias]
    return tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)
