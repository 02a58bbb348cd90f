"""What kv_manager reports on /diagnostics, read from the shared EngineHost.

Read without the engine lock (a diagnostics tick must never wait for a cycle):
the figures are counters and sizes, so a value that is one cycle stale is fine.
"""

from __future__ import annotations

from diagnostic_msgs.msg import DiagnosticStatus

from embodied_kv.kernels import fallback
from embodied_kv.ros import heap
from embodied_kv.ros.engine_host import EngineHost

RATE_TOLERANCE = 0.05  # WARN when the action rate is off its target by more than this


def diagnostics_sections(host: EngineHost) -> dict[str, tuple[bytes, str, dict]]:
    engine, cfg = host.engine, host.cfg
    if engine is None:
        return {"engine": (DiagnosticStatus.STALE, "not configured", {})}
    sections = {"action output": _output(host)}

    cycles, loop, faults = host.cycles.counters, engine.loop.counters, engine.faults
    if faults.safe:  # repeated failures: the last action is held, language paused
        level, message = DiagnosticStatus.ERROR, f"safe state: {faults.safe_reason}"
    elif loop.wait_timeouts:  # a persistent launch gave up waiting: its outputs were wrong
        level, message = DiagnosticStatus.ERROR, (
            f"{loop.wait_timeouts} persistent launch(es) had a wait time out (their "
            "outputs are wrong: kernels/work_queue.py)")
    elif host.cycles.running:
        level, message = DiagnosticStatus.OK, "held (goal cancelled)" if engine.held else "cycling"
    else:
        level, message = DiagnosticStatus.STALE, "stopped (action_expert inactive)"
    sections["engine"] = (
        level,
        message,
        {
            "preset": cfg.preset,
            "weights": engine.source.label if engine.source else "given model",
            "device": cfg.device,
            "cycle_period_ms": 1e3 * cfg.period_s,
            "cycles": cycles.cycles,
            "late_starts": cycles.late_starts,
            # ticks between the robot state a chunk starts from and the cycle's start
            "observation_age_ticks": cycles.observation_age_ticks,
            "unstamped_observations": cycles.unstamped,
            "chunks_after_deadline": loop.action_late,
            "persistent_wait_timeouts": loop.wait_timeouts,
            "cycle_overruns": loop.overruns,
            "cycle_errors": cycles.errors,
            "cycle_failures": faults.failures,
            "last_error": faults.last_error,
            "safe_state_entries": faults.safe_entries,
            "held": engine.held,
            "tokens_per_s": host.cycles.tokens_per_s(),
            "tokens": cycles.tokens,
            "live_requests": len(engine.manager.live()),
            "frame": engine.frame,
            "action_mode": cfg.action_mode,
            # fused ops whose Triton kernel could not be built here: their reference runs
            "kernels_off": ", ".join(sorted(fallback.OFF)),
            "kernels_off_reasons": "; ".join(f"{k}: {v}" for k, v in sorted(fallback.OFF.items())),
        },
    )
    sections["language"] = _language(engine)
    if engine.action_tokens is not None:  # ar mode: invalid sequences became zeros
        sections["engine"][2].update(_ar(engine))
    sections["engine"][2].update(_chunks(engine))

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

    memory = engine.memory.summary()
    sections["planner memory"] = (
        DiagnosticStatus.OK,
        f"{memory['segments']} segments, {memory['static_groups']}/{memory['groups']} groups "
        f"static ({cfg.memory_mode})",
        {**memory, "mode": cfg.memory_mode, "keep_fallbacks": engine.planner.fallbacks,
         "keep_small_memory": engine.planner.small},
    )

    store = engine.store
    tiers = store.bytes_by_tier()
    sections["capsules"] = (
        DiagnosticStatus.OK,
        f"{len(store.names())} capsules",
        {
            **{f"{tier}_bytes": n for tier, n in tiers.items()},
            "gpu_budget_bytes": cfg.store.gpu_bytes,
            "host_budget_bytes": cfg.store.host_bytes,
            "disk_budget_bytes": cfg.store.disk_bytes,
            "restores": engine.counters.restores,
            **{f"disk_{k}": v for k, v in vars(store.counters).items()},
            "disk_last_warning": (store.warnings or [""])[-1],
            "ended_ledger_error": engine.ended.last_error,
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
            # a full GC stops every thread, this one's too (ros/heap.py)
            "gc_full_collections": heap.FULL.count,
            "gc_full_pause_max_ms": heap.FULL.max_ms,
            "gc_frozen_objects": heap.frozen(),
        },
    )


def _language(engine) -> tuple[bytes, str, dict]:
    """Admission: every refusal, deferral, early end and cancellation is counted."""
    m, s = engine.manager.counters, engine.counters
    pending = len(engine.policy.pending())
    return (
        DiagnosticStatus.OK,
        f"{len(engine.manager.live())} live, {pending} waiting",
        {
            "waiting": pending,
            "max_pending": engine.cfg.max_pending,
            "requests": m.requests,
            "finished": m.finished,
            "truncated": m.truncated,
            "deferred": m.deferred,
            "refused_queue_full": s.refused_queue_full,
            "refused_too_long": s.refused_too_long + m.refused,
            "cancelled": s.cancelled,
            "dropped_ended": s.dropped_ended,  # ended requests a restored capsule held
            "narrations_skipped": m.narrations_skipped,
            "instructions_truncated": m.prompts_truncated,
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


def _chunks(engine) -> dict:
    """Chunk boundaries (engine/action_queue.py) and real-time chunking (docs/rtc.md)."""
    sw = engine.queue.switches
    out = {
        "chunk_switches": sw.switches,
        "boundary_jump_last": sw.last_jump,
        "boundary_jump_max": sw.max_jump,
        "inference_delay_ticks": -1 if sw.last_delay is None else sw.last_delay,
        "rtc_enabled": engine.cfg.rtc.enabled,
    }
    rtc = getattr(engine.loop, "rtc", None)
    if rtc is not None:
        c = rtc.counters
        out["rtc_applied"] = c.last_applied
        out["rtc_guided_chunks"] = c.guided
        out["rtc_delay_ticks"] = -1 if c.last_delay is None else c.last_delay
        out["rtc_stale_observations"] = c.stale_observations
    return out
