"""`bench keep`'s host-work census: one more plan request per method, untimed, under
the host-work counter (bench/host_work.py), as the engine's plan admission runs it."""

from __future__ import annotations

from embodied_kv.bench.host_work import Count, HostWork, arena_host, model_seed
from embodied_kv.bench.keep_stream import Stream
from embodied_kv.kv.memory import MemoryOp
from embodied_kv.kv.memory_kv import layout


def host_work_plan(model, arena, frame: int, family: list, stream: Stream, mems: tuple,
                   n: int, compute) -> dict:  # fmt: skip
    """One more plan request, untimed, under the host-work counter (bench/host_work.py):
    per method, what its plan costs the host: the memory's refresh after the updates
    (`refresh`: the blocks they invalidated computed), then the prefill and the first
    token read (`prefill`), as the engine's plan admission runs them."""
    grouped, chunks = mems
    for _ in range(2):
        key, text, group = stream.update()
        for mem in (grouped, chunks):
            mem.apply(MemoryOp.UPDATE, key, text, n, group)
    hw = HostWork(model_seed(model, arena), arena_host(arena))
    made = {}
    with hw:
        for name, mem in (("grouped", grouped), ("chunks", chunks)):
            with hw.region(f"refresh/{name}"):
                made[name] = mem.refresh(compute)
        texts = [t for u in grouped.units() for t in u.texts]
        query, _ = stream.query(2, texts)
        lays = {True: layout(model, grouped.units(), grouped.blocks, query),
                False: layout(model, chunks.units(), chunks.blocks, query)}  # fmt: skip
        for m in family:
            lay = lays[m.grouped] if m.cached else lays[True]
            slot = arena.allocate()
            arena.copy_slot(frame, slot)
            runner = getattr(m, "runner", None)
            before = runner.replays if runner is not None else 0
            with hw.region(m.name) as c:
                int(m.prefill(model, arena, slot, lay, frame).argmax())
            arena.release(slot)
            if runner is not None and runner.replays - before > c.graph_replays:
                # a CUDA graph's replay, bound before the counter patched CUDAGraph.replay
                c.launches += runner.replays - before - c.graph_replays
                c.graph_replays = runner.replays - before
    out = {}
    for m in family:
        blocks = "grouped" if m.name.startswith("keep") and m.name != "keep-no-static" else "chunks"
        refresh = hw.counts[f"refresh/{blocks}"] if m.cached else Count()
        out[m.name] = {"prefill": hw.counts[m.name].as_dict(), "refresh": refresh.as_dict(),
                       "blocks_computed": made[blocks] if m.cached else 0}  # fmt: skip
    return out
