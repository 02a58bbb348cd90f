"""What kv_manager reports on /diagnostics, read from the shared EngineHost.

Read without the engine lock (a diagnostics tick must never wait for a cycle):
the figures are counters and sizes, so a value that is one cycle stale is fine.
"""

from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticStatus

from embodied_kv.ros.engine_host import EngineHost

RATE_TOLERANCE = 0.05  # WARN when the action rate is off its target by more than this


def diagnostics_sections(host: EngineHost) -> dict[str, tuple[bytes, str, dict]]:
    engine, cfg = host.engine, host.cfg
    if engine is None:
        return {"engine": (DiagnosticStatus.STALE, "not configured", {})}
    sections = {"action output": _output(host)}

    cycles, loop = host.cycles.counters, engine.loop.counters
    sections["engine"] = (
        DiagnosticStatus.OK if host.cycles.running else DiagnosticStatus.STALE,
        "cycling" if host.cycles.running else "stopped (action_expert inactive)",
        {
            "preset": cfg.preset,
            "device": cfg.device,
            "cycle_period_ms": 1e3 * cfg.period_s,
            "cycles": cycles.cycles,
            "late_starts": cycles.late_starts,
            "chunks_after_deadline": loop.action_late,
            "cycle_overruns": loop.overruns,
            "cycle_errors": cycles.errors,
            "tokens_per_s": host.cycles.tokens_per_s(),
            "tokens": cycles.tokens,
            "live_requests": len(engine.manager.live()),
            "frame": engine.frame,
            "action_mode": cfg.action_mode,
        },
    )
    if engine.action_tokens is not None:  # ar mode: invalid sequences became zeros
        sections["engine"][2].update(_ar(engine))

    arena = engine.manager.arena
    used = arena.in_use()
    rows = sum(arena.slot_len(s) for s in used)
    sections["kv arena"] = (
        DiagnosticStatus.OK,
        f"{len(used)}/{arena.spec.num_slots} slots in use",
        {
            "slots_used": len(used),
            "slots": arena.spec.num_slots,
            "rows_used": rows,
            "occupancy": rows / (arena.spec.num_slots * arena.spec.max_len),
            "arena_bytes": arena.spec.bytes,
        },
    )

    tiers = engine.store.bytes_by_tier()
    sections["capsules"] = (
        DiagnosticStatus.OK,
        f"{len(engine.store.list())} capsules",
        {
            **{f"{tier}_bytes": n for tier, n in tiers.items()},
            "gpu_budget_bytes": cfg.store.gpu_bytes,
            "host_budget_bytes": cfg.store.host_bytes,
            "disk_budget_bytes": cfg.store.disk_bytes,
        },
    )
    rejected = dict(host.inputs_rejected)
    sections["inputs"] = (
        DiagnosticStatus.OK,
        f"{sum(rejected.values())} inputs rejected",
        {f"rejected_{kind}": n for kind, n in sorted(rejected.items())},
    )
    return sections


def _output(host: EngineHost) -> tuple[bytes, str, dict]:
    output, target = host.output, host.cfg.control_hz
    if output is None or not output.running:
        return DiagnosticStatus.STALE, "stopped (action_expert inactive)", {"target_hz": target}
    stats, c = output.stats(), output.counters
    off = abs(stats["rate_hz"] - target) > RATE_TOLERANCE * target
    level = DiagnosticStatus.WARN if off else DiagnosticStatus.OK
    return (
        level,
        f"{stats['rate_hz']:.1f} Hz (target {target:g})",
        {
            "target_hz": target,
            **stats,
            "published": c.published,
            "deadline_misses": c.misses,
            "waiting_for_first_chunk": c.waiting,
            "late": c.late,
            "skipped": c.skipped,
            "errors": c.errors,
        },
    )


def _ar(engine) -> dict:
    flow = engine.loop.flow
    return {
        "action_tokens": engine.action_tokens.kind,
        "pipeline_depth_k": flow.k,
        "frames_in_flight": flow.in_flight(),
        "actions_decoded": flow.counters.actions,
        "actions_invalid": flow.counters.invalid,
        "actions_capped": flow.counters.capped,
    }
