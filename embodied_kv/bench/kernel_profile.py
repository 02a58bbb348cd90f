"""`embodied-kv bench latency --kernels`: the top kernels of the action path, by device time.

A separate pass after the headline rounds (and the breakdown), on the graphs engine:
`torch.profiler` over a few control cycles, then the TOP entries of `key_averages()` by self
device time (on CUDA: the kernels, those replayed inside CUDA graphs too, and the copies;
on a CPU: the operators by self CPU time, the code path only). Each entry: name, calls,
total and mean microseconds, and its share of the pass's device time. The profiler's own
table is kept beside (`table`), as torch prints it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from embodied_kv.engine.engine import Engine
from embodied_kv.model.vla import Observation

TOP = 20


def _self_us(event, cuda: bool) -> float:
    """An averaged event's self time in us (torch names it `self_device_time_total` since
    2.4; `self_cuda_time_total` before)."""
    if not cuda:
        return float(event.self_cpu_time_total)
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    raise AttributeError("this torch's profiler events have no self device time")


def top_kernels(model, engine: Engine, observations: Iterable[Observation]) -> dict:
    """One control cycle per observation under the profiler -> the TOP entries by self
    device time (CPU time on a CPU) and the profiler's table."""
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    model.graphs = engine.graphs
    cycles = 0
    with profile(activities=activities) as prof:
        for obs in observations:
            engine.observe(obs)
            engine.cycle(engine.frame * engine.cfg.replan_every)
            cycles += 1
        if cuda:
            torch.cuda.synchronize(model.device)
    events = list(prof.key_averages())
    total = sum(_self_us(e, cuda) for e in events) or 1.0
    events.sort(key=lambda e: _self_us(e, cuda), reverse=True)
    rows = [
        {"name": e.key, "calls": int(e.count), "self_us": round(_self_us(e, cuda), 1),
         "mean_us": round(_self_us(e, cuda) / max(1, e.count), 2),
         "share": round(_self_us(e, cuda) / total, 4)}
        for e in events[:TOP]
    ]  # fmt: skip
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    try:  # the text table is a convenience: its failure never costs the rows above
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP, max_name_column_width=80)
    except Exception as e:  # noqa: BLE001 - e.g. another torch's column names
        table = f"(no table: {type(e).__name__}: {e})"
    return {
        "sorted_by": "self device time" if cuda else "self CPU time (no device here)",
        "cycles": cycles, "total_self_us": round(total, 1), "rows": rows, "table": table,
    }  # fmt: skip


def report(rows: list[dict]) -> None:
    """Each camera count's top kernels."""
    for r in rows:
        k = r.get("kernels")
        if not k:
            continue
        per_cycle = k["total_self_us"] / k["cycles"] / 1e3
        print(f"{r['cameras']} cameras: top {len(k['rows'])} by {k['sorted_by']}, "
              f"{k['cycles']} cycles, {per_cycle:.2f} ms a cycle")  # fmt: skip
        for e in k["rows"]:
            print(f"  {e['share'] * 100:5.1f} %  {e['self_us'] / k['cycles']:9.1f} us/cycle  "
                  f"{e['calls'] // k['cycles']:4} calls/cycle  {e['name'][:90]}")  # fmt: skip
