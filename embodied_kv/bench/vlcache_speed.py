"""Speed of decoding over compressed slots and the cost of the statistics (`bench vlcache`).

    decode step      B language requests, one token each, over B full slots vs B slots
                     compressed to the budget (the whole packed step: every layer, LM head)
    attention        the same step's attention calls alone (every layer): what VL-Cache saves
                     directly; the rest of a step (weights, LM head) does not change with the
                     KV, so the step's ratio is smaller wherever weights dominate
    prefill          a frame's prefill with VL-Cache's recorder vs without (the critical path),
                     and with the statistics and selection that follow the expert (the total)
    expert           the action chunk over a compressed prefix (`compress_expert`) vs the full
    KV bytes         rows kept over all layers x bytes per row

A timed decode step appends a row to each slot: after every call the slots are rewound
(lengths and next_pos put back), so every repeat decodes over the same rows.
"""

from __future__ import annotations

import torch

from embodied_kv.bench import harness, host_work
from embodied_kv.kernels.packed_attention import packed_attention
from embodied_kv.kv.compress import CompressConfig, Compressor, PrefixLayout, compact
from embodied_kv.storage.step import Segment, plan_step

INNER = 5  # calls per timed sample (harness.looped): sub-10 ms work on a shared machine


def prefix_slots(model, arena, prefix, n: int, budget: float | None) -> list[int]:
    """n slots holding `prefix`, compressed to `budget` by VL-Cache (None: full)."""
    comp = Compressor(CompressConfig(budget=budget or 1.0), model)
    layout = PrefixLayout(prefix.embeds.shape[0], prefix.n_image)
    slots = [arena.allocate() for _ in range(n)]
    rec = comp.recorder(slots[0], layout)
    model.prefill(arena, slots[0], prefix, observer=rec)
    if budget is not None:
        compact(arena, slots[0], comp.select(layout, rec))
    for s in slots[1:]:
        arena.copy_slot(slots[0], s)
    return slots


def decode_call(model, arena, slots: list[int]):
    """One batched decode step over `slots`, rewound afterwards."""
    lens, pos = arena.length[:, slots].clone(), arena.next_pos[slots].clone()
    ids = torch.zeros(len(slots), dtype=torch.long, device=model.device)

    def run():
        model.decode(arena, slots, ids)
        arena.length[:, slots] = lens
        arena.next_pos[slots] = pos

    return run


def attention_call(model, arena, slots: list[int]):
    """Every layer's packed attention of one decode step over `slots` (random queries)."""
    plan = plan_step(arena, [Segment(s, 1) for s in slots])
    b = model.cfg.backbone
    g = torch.Generator().manual_seed(0)
    q = torch.randn(plan.n_padded, b.heads, b.head_dim, generator=g).to(model.device, model.dtype)
    scale = model.backbone.scale

    def run():
        for i in range(b.layers):
            packed_attention(q, arena.k[i], arena.v[i], plan.slot, plan.kv_len[i], scale,
                             plan.runs, plan.kv_len_host[i])  # fmt: skip

    return run


def expert_call(model, arena, slot: int, prefix_len: int, compressed: bool):
    noise = model.make_noise(0)
    return lambda: model.sample_actions(arena, slot, prefix_len, noise, compressed)


def kv_bytes(arena, slots: list[int]) -> int:
    spec = arena.spec
    per_row = 2 * spec.kv_heads * spec.head_dim * arena.k.element_size()
    return int(arena.length[:, slots].sum()) * per_row


def measure(model, prefix, budgets: list[float], batch: int, repeats: int) -> dict:
    """Rows per budget (decode and attention ratios vs full, KV bytes) and the statistics'
    prefill overhead; every timing interleaved with its full-cache twin."""
    dev = model.device
    n = prefix.embeds.shape[0]
    arena = model.new_arena(batch * (1 + len(budgets)) + 1, -(-(n + 8) // 64) * 64)
    full = prefix_slots(model, arena, prefix, batch, None)
    fns = {"full/step": decode_call(model, arena, full),
           "full/attn": attention_call(model, arena, full),
           "full/expert": expert_call(model, arena, full[0], n, False)}  # fmt: skip
    kept = {}
    for b in budgets:
        slots = prefix_slots(model, arena, prefix, batch, b)
        fns[f"{b:g}/step"] = decode_call(model, arena, slots)
        fns[f"{b:g}/attn"] = attention_call(model, arena, slots)
        fns[f"{b:g}/expert"] = expert_call(model, arena, slots[0], n, True)
        kept[b] = (kv_bytes(arena, slots[:1]), arena.length[:, slots[0]].tolist())
    times = harness.interleave({k: harness.looped(f, INNER) for k, f in fns.items()}, dev,
                               warmup=1, repeats=repeats)  # fmt: skip
    seed, host = host_work.model_seed(model, arena), host_work.arena_host(arena)
    work = {k: host_work.count(f, seed, host) for k, f in fns.items() if k.endswith("/step")}
    rows = []
    for b in budgets:
        rows.append({
            "budget": b,
            "rows_per_layer": kept[b][1],
            "kv_bytes": kept[b][0],
            "kv_bytes_full": kv_bytes(arena, full[:1]),
            "decode_step_ms": harness.Stats.of(times[f"{b:g}/step"]).median / INNER,
            "decode_step_full_ms": harness.Stats.of(times["full/step"]).median / INNER,
            "decode_speedup": harness.ratio(times["full/step"], times[f"{b:g}/step"]),
            "attention_speedup": harness.ratio(times["full/attn"], times[f"{b:g}/attn"]),
            "expert_speedup": harness.ratio(times["full/expert"], times[f"{b:g}/expert"]),
            "host_work_per_step": work[f"{b:g}/step"],  # bench/host_work.py, one decode step
            "host_work_per_step_full": work["full/step"],
        })  # fmt: skip
    return {"batch": batch, "prefix_rows": n, "image_rows": prefix.n_image, "rows": rows,
            "prefill": prefill_overhead(model, prefix, repeats)}  # fmt: skip


def prefill_overhead(model, prefix, repeats: int) -> dict:
    """A prefill with VL-Cache's recorder vs a plain one (the same slot): `overhead` on the
    prefill itself (the action's critical path: the recorder keeps query rows), and
    `overhead_total` with the statistics and the selection that follow the action expert."""
    n = prefix.embeds.shape[0]
    arena = model.new_arena(1, -(-n // 64) * 64)
    slot = arena.allocate()
    comp = Compressor(CompressConfig(budget=0.1), model)
    layout = PrefixLayout(n, prefix.n_image)

    def plain():
        arena.clear(slot)
        model.prefill(arena, slot, prefix)

    def recorded():
        arena.clear(slot)
        rec = comp.recorder(slot, layout)
        model.prefill(arena, slot, prefix, observer=rec)
        return rec

    def selected():
        comp.select(layout, recorded())  # statistics, budgets and top-k: the whole cost

    fns = {"plain": plain, "recorded": recorded, "selected": selected}
    t = harness.interleave(fns, model.device, 1, repeats)
    return {
        "prefill_ms": harness.Stats.of(t["plain"]).median,
        "prefill_stats_ms": harness.Stats.of(t["recorded"]).median,
        "prefill_select_ms": harness.Stats.of(t["selected"]).median,
        "overhead": harness.ratio(t["recorded"], t["plain"]) - 1.0,
        "overhead_total": harness.ratio(t["selected"], t["plain"]) - 1.0,
    }
