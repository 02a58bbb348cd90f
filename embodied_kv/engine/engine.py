"""The engine facade: one model, one KV manager, one action queue, one capsule store.

This is what the ROS nodes, the demo and the benchmarks drive. Every verb on the
session takes the engine lock, so a service call never interleaves with a control
cycle; the action queue has its own lock and is popped by the output path without
waiting for it, and ask() / memory updates take only the policy's / memory's lock.

The session (docs/ARCHITECTURE.md) is everything a capsule carries: KV slots, every request's
generation state, the requests still waiting (policy), the id counters, the planner
memory, the action queue, the latest observation, the frame. `episode_start` and the
automatic per-cycle history (`auto-*`) are the engine's own capsule names; clients
cannot write them. Restore is validate + stage, then swap (kv/capsule.py): a failed
snapshot / restore / reset / rollback leaves the session and the store as they were.
Every request ends once: a restore drops the requests the capsule holds whose final
event has already left, here or in another process (engine/ended.py, docs/requests.md).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.admission import fit_problem
from embodied_kv.engine.ar_loop import ARLoop
from embodied_kv.engine.config import EngineConfig
from embodied_kv.engine.ended import EndedRequests
from embodied_kv.engine.events import OpenRequests, TextEvent, cancellations, open_requests
from embodied_kv.engine.faults import CycleFaults
from embodied_kv.engine.frame_loop import CycleResult, FrameLoop
from embodied_kv.engine.graphs import GraphRunner, default_mode
from embodied_kv.engine.history import EPISODE_START, StepHistory, check_client_name
from embodied_kv.engine.loading import load_model, model_source
from embodied_kv.engine.observation_state import (
    check_observation,
    load_observation,
    observation_meta,
    observation_tensors,
)
from embodied_kv.engine.plan_memory import MemoryPlanner, embedder
from embodied_kv.engine.policy import LoopConfig, QueueFull, answer_suffix, arena_rows
from embodied_kv.engine.rtc_guide import ChunkGuide
from embodied_kv.kv.capsule import (
    Identity,
    capture,
    check_identity,
    fork_slots,
    identity_of,
    stage,
)
from embodied_kv.kv.capsule_store import CapsuleInfo, CapsuleStore
from embodied_kv.kv.manager import KVCacheManager, Status, TaskKind
from embodied_kv.kv.memory import SegmentMemory
from embodied_kv.model.action_space import RobotIO
from embodied_kv.model.action_tokens import make_action_tokenizer
from embodied_kv.model.robot_loader import load_robot_io
from embodied_kv.model.vla import Observation
from embodied_kv.timing import device_clock, elapsed_ms

__all__ = ["EPISODE_START", "Engine", "EngineConfig", "check_client_name"]


@dataclass
class SessionCounters:
    """Process counters of the session verbs (diagnostics; never restored)."""

    refused_queue_full: int = 0
    refused_too_long: int = 0
    cancelled: int = 0  # requests dropped by a restore (reset, rollback), each told so
    dropped_ended: int = 0  # requests a restored capsule held that had already ended
    restores: int = 0


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        model=None,
        robot: RobotIO | None = None,
        graph_mode: str | None = None,
    ):
        """graph_mode: engine/graphs.py's "cuda", "emulate" or "off"; None = CUDA graphs
        on a CUDA device when cfg.cuda_graphs, else none."""
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        # an own-layout weights file's config, or the preset's; the preset's shipped weights
        self.source = model_source(cfg) if model is None else None
        c = model.cfg if model is not None else self.source.cfg
        weights = self.source.weights if self.source else cfg.weights
        # The robot's units at the engine boundary: observe() normalises the state, every
        # chunk is un-normalised and sliced before the queue (model/action_space.py).
        self.robot = robot or load_robot_io(cfg.robot, weights, c.state_dim, c.action_dim)
        self.lock = threading.RLock()
        loop_cfg = LoopConfig(
            period_s=cfg.period_s,
            narrate_every=cfg.narrate_every,
            narration_tokens=cfg.narration_tokens,
            answer_tokens=cfg.answer_tokens,
            max_decode_steps=cfg.max_decode_steps,
            seed=cfg.seed,
            max_pending=cfg.max_pending,
            request_tokens=cfg.request_tokens,
        )
        rows = arena_rows(cfg.max_len, c, loop_cfg)  # a bad max_len fails before any weights
        self.model = model or load_model(cfg, self.source)
        self.manager = KVCacheManager(self.model, cfg.num_slots, rows, cfg.compress)
        self.action_tokens = None
        if cfg.action_mode == "ar":  # the model's vocabulary holds the action ids
            tok = make_action_tokenizer(cfg.ar, self.model.cfg, self.model.tokenizer)
            self.action_tokens = tok
            self.queue = ActionQueue(tok.horizon, self.robot.action_dim, cfg.blend)
            self.loop = ARLoop(
                self.manager, self.queue, loop_cfg, tok, cfg.ar_unified, robot=self.robot
            )
        else:
            self.queue = ActionQueue(
                c.action_horizon, self.robot.action_dim, cfg.blend, cfg.rtc.delay_ema
            )
            rtc = None
            if cfg.rtc.enabled:
                rtc = ChunkGuide(cfg.rtc, c.action_horizon, cfg.replan_every, self.model.device,
                                 self.robot.action_dim)  # fmt: skip
            self.loop = FrameLoop(self.manager, self.queue, loop_cfg, robot=self.robot, rtc=rtc)
        self.policy = self.loop.policy
        self.memory = SegmentMemory(cfg.memory, embedder(self.model))
        self.planner = MemoryPlanner(self.model, self.memory, cfg.memory_mode, cfg.keep,
                                     cfg.keep_min_segments)  # fmt: skip
        self.loop.planner = self.planner
        self.store = CapsuleStore(cfg.store, self.model.device)
        self.ended = EndedRequests(self.store)  # ids a restore must never bring back
        if graph_mode is None:
            graph_mode = default_mode(self.model.device) if cfg.cuda_graphs else "off"
        self.graphs = None
        if graph_mode != "off":
            self.graphs = GraphRunner(self.model, self.manager.arena, mode=graph_mode)
            self.model.graphs = self.graphs
            if cfg.keep_graphs:
                self.planner.use_graphs(self.graphs)
        base = identity_of(self.model, self.manager.arena)
        # The action queue a capsule holds is in robot units: other statistics, dims or
        # delta mask make it another config.
        robot = hashlib.sha256((base.config + self.robot.fingerprint()).encode()).hexdigest()
        self.identity = Identity(base.weights, robot)
        self.frame = 0
        self.instruction = ""
        self.steps = StepHistory(self._forget_capsule, cfg.history)  # rollback by steps
        self.faults = CycleFaults(cfg.max_cycle_failures)
        self.counters = SessionCounters()
        self.held = False  # hold(): no new chunks, the last action repeats
        self._obs: Observation | None = None
        self._outbox: list[TextEvent] = []  # final events of requests a restore dropped

    # -- inputs ----------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        """obs.state in robot units ([robot.state_dim]); ValueError if it does not fit."""
        model_obs = self.robot.model_observation(obs)
        with self.lock:
            if obs.instruction != self.instruction:  # a new task: its first chunk is free
                self.queue.forget_plan()  # (real-time chunking joins chunks of one task)
            self._obs = model_obs
            self.instruction = obs.instruction

    def ask(self, text: str, kind: TaskKind = TaskKind.ANSWER) -> tuple[str, TextEvent | None]:
        """Queue a question (or a PLAN prompt) -> (request id, None), or (request id, its
        final REFUSED event) when the queue is full or the prompt cannot fit a slot with
        the frame's longest prefix and the whole token budget (never cut)."""
        policy = self.policy
        request_id = policy.next_id(kind)
        suffix = answer_suffix(text) if kind is TaskKind.ANSWER else text
        n = len(self.model.tokenizer.encode(suffix, bos=False))
        budget = policy.cfg.answer_tokens
        rows = self.manager.arena.spec.max_len
        reason = fit_problem(self.model.cfg.prefix_tokens_max, n, budget, rows)
        if reason:
            self.counters.refused_too_long += 1
            return request_id, self._refused(request_id, kind, reason)
        try:
            policy.enqueue(request_id, text, kind)
        except QueueFull as e:
            self.counters.refused_queue_full += 1
            return request_id, self._refused(request_id, kind, str(e))
        return request_id, None

    def plan(self, goal: str) -> tuple[str, TextEvent | None]:
        """A plan request over the memory as text (see ask)."""
        return self.ask(self.memory.prompt(goal), TaskKind.PLAN)

    def update_memory(
        self, op: int, key: str, text: str, max_segments: int, group: str = ""
    ) -> None:
        """One memory update (SegmentMemory.apply; ValueError leaves the memory unchanged).
        Blocks it invalidates are computed again by the next plan that reads them."""
        self.memory.apply(op, key, text, max_segments, group)

    def _refused(self, request_id: str, kind: TaskKind, reason: str) -> TextEvent:
        return TextEvent(request_id, kind, self.frame, "", "", True, False, Status.REFUSED, reason)

    # -- the control cycle -------------------------------------------------------------

    def cycle(self, tick: int) -> CycleResult | None:
        """One control cycle on the latest observation; None before the first one.

        A cycle that raises is undone (slots it took released) and counted; the error
        is raised. Held or in the safe state, no cycle runs: the result (chunk None)
        carries only the final events of requests a restore dropped, if any."""
        with self.lock:
            if self._obs is None:
                return None
            if self.held or self.faults.safe:
                events = self.take_events()
                if not events:
                    return None
                return CycleResult(self.frame, None, 0, 0.0, 0.0, 0, 0.0, events)
            before = set(self.manager.arena.in_use())
            try:
                result = self.loop.cycle(self._obs, self.frame, tick)
            except Exception as e:
                self._undo_cycle(before)
                if self.faults.failed(e, self.frame):
                    self.queue.hold()
                raise
            self.faults.succeeded()
            self.ended.add(e.request_id for e in result.events if e.done)
            self.frame += 1
            if self.cfg.history:
                self._record_boundary()
            result.events[:0] = self.take_events()
            return result

    def draw_noise_ahead(self, frame: int) -> None:
        """Draw the noise of `frame` now, off its action path, where the frame loop's
        `draw_ahead` is off. A cycle of another frame draws its own: the same bytes
        either way (engine/noise_ahead.py)."""
        with self.lock:
            seed = self.cfg.seed + frame
            if self.loop.noise.seed != seed:
                self.loop.noise.draw(seed)

    def _undo_cycle(self, before: set[int]) -> None:
        """Release every slot the failed cycle took that no request holds."""
        arena = self.manager.arena
        held = {r.slot for r in self.manager.requests.values() if r.slot is not None}
        for s in arena.in_use():
            if s not in before and s not in held:
                arena.release(s)

    def finish_all(self) -> list[TextEvent]:
        """Decode every live request to its end without a deadline (shutdown, tests):
        their final events leave here, so they have ended like any other."""
        with self.lock:
            events = self.take_events() + self.loop.finish_all()
            self.ended.add(e.request_id for e in events if e.done)
            return events

    def take_events(self) -> list[TextEvent]:
        with self.lock:
            events, self._outbox = self._outbox, []
            return events

    def hold(self) -> None:
        """Stop cycling: the last action repeats, language pauses (a cancelled goal)."""
        with self.lock:
            self.held = True
            self.queue.hold()

    def resume(self) -> None:
        with self.lock:
            self.held = False

    def warmup(self) -> None:
        """Capture the CUDA graphs (on CUDA) and run one cycle's work without a deadline."""
        with self.lock:
            if self.graphs is not None:
                self.graphs.capture(self.cfg.rtc)
            if self._obs is not None:
                self.loop.warmup(self._obs)

    # -- episodes and capsules ---------------------------------------------------------

    def begin_episode(self) -> None:
        """Empty every slot, request, queue and the memory; frame 0; snapshot
        `episode_start` (pinned): what `reset` restores."""
        with self.lock:
            open_before = self._open_requests()
            for req in list(self.manager.requests.values()):
                self.manager.release(req)
            for s in self.manager.arena.in_use():
                self.manager.arena.release(s)
            if isinstance(self.loop, ARLoop):
                self.loop.flow.reserve()  # the ring's slots stay the pipeline's
            self.policy.take_pending()
            self.memory.clear()
            self.queue.load_state(
                {"last": torch.zeros(self.queue.action_dim, dtype=torch.float64)}, {"start": 0}
            )
            self.frame = 0
            self.steps.clear()
            self._new_timeline(open_before, "cancelled: a new episode began")
            if self.cfg.auto_episode_capsule:
                self._snapshot(EPISODE_START, "gpu", pin=True)

    def sections(self) -> dict:
        sections = {"queue": self.queue, "policy": self.policy, "memory": self.memory}
        if isinstance(self.loop, ARLoop):  # the frames in flight are state
            sections["pipeline"] = self.loop.flow
        return {**sections, "engine": self}

    def snapshot(
        self, name: str, tier: str = "gpu", pin: bool = False
    ) -> tuple[CapsuleInfo, float]:
        """Capture the whole session under a client's name -> (info, elapsed ms)."""
        check_client_name(name)
        with self.lock:
            ms = self._snapshot(name, tier, pin)
            return self.store.info(name), ms  # the digest is computed here, off the cycle

    def _snapshot(self, name: str, tier: str, pin: bool) -> float:
        """Capture under any name -> elapsed ms (the history's path: no digest)."""
        with self.lock:
            clock = device_clock(self.model.device)
            t = clock()
            cap = capture(
                name,
                self.manager.arena,
                self.manager,
                self.identity,
                self.sections(),
                {"instruction": self.instruction, "frame": self.frame},
            )
            self.store.put(cap, tier, pin)
            self.ended.sync()  # a capsule that holds ended ids may have reached the disk
            return elapsed_ms(t, clock)

    def restore(self, name: str = EPISODE_START, kv_only: bool = False) -> float:
        """Restore a capsule into the live state -> elapsed ms. Starts a new timeline:
        the automatic history of the old one is dropped (rollback by steps cannot walk
        back into it); requests the capsule does not hold end with CANCELLED.
        "" = `episode_start`."""
        with self.lock:
            ms = self._restore(name or EPISODE_START, kv_only)
            self.steps.clear()
            return ms

    reset = restore  # `reset` of the kv_manager: a new episode from a capsule

    def _restore(self, name: str, kv_only: bool = False) -> float:
        clock = device_clock(self.model.device)
        t = clock()
        cap = self.store.load(name)  # disk: read and verified; the store is unchanged
        staged = stage(
            cap, self.manager.arena, self.manager, self.identity, self.sections(), kv_only
        )
        open_before = self._open_requests()
        staged.apply()  # copies into fixed buffers and object swaps only
        if not kv_only:
            self._drop_ended(cap.meta)
        ms = elapsed_ms(t, clock)
        self.store.used(cap)  # LRU + promotion, best effort
        self.ended.sync()
        self.counters.restores += 1
        self._new_timeline(open_before, f"cancelled: the session was restored to {name!r}")
        return ms

    def rollback(self, name: str = "", steps_back: int = 0) -> float:
        """Restore a named capsule, or the boundary `steps_back` engine cycles before the
        last one of this timeline (one cycle = replan_every control ticks)."""
        with self.lock:
            if name:
                return self.restore(name)
            ms = self._restore(self.steps.target(steps_back))
            self.steps.drop_after(steps_back)
            return ms

    def fork(self, name: str, n: int) -> list[list[int]]:
        """n independent copies of a capsule's slots in free slots -> slot ids per branch."""
        with self.lock:
            cap = self.store.load(name)
            check_identity(cap, self.identity)
            return fork_slots(cap, self.manager.arena, n)

    def _drop_ended(self, meta: dict) -> None:
        """Requests the capsule holds whose final event has already left (here or, by the
        disk tier's ledger, in another process) are not restored: slots and queue places
        go back. An id that has ended never produces another event (docs/requests.md)."""
        ended = self.ended.of(meta)
        for rid in ended & set(self.manager.requests):
            self.manager.release(self.manager.requests[rid])
        if ended:
            self.policy.discard(ended)
        self.counters.dropped_ended += len(ended)

    def _open_requests(self) -> OpenRequests:
        return open_requests(self.manager, self.policy.pending(), self.frame)

    def _new_timeline(self, open_before: OpenRequests, reason: str) -> None:
        """After the session changed wholesale: new request ids, every request that
        was open and is gone gets its final CANCELLED event, the loop runs again."""
        self.policy.epoch.advance()
        gone = cancellations(open_before, self._open_requests(), reason)
        self.ended.add(e.request_id for e in gone)
        self.counters.cancelled += len(gone)
        self._outbox += gone
        self.faults.clear()
        self.held = False

    def _record_boundary(self) -> None:
        try:
            self.steps.record(self.policy.epoch.nonce, lambda n: self._snapshot(n, "gpu", False))
        except (OSError, RuntimeError, ValueError) as e:  # history is best effort
            self.faults.last_error = f"history snapshot: {type(e).__name__}: {e}"

    def _forget_capsule(self, name: str) -> None:
        if name in self.store:
            self.store.delete(name)

    @property
    def history(self) -> list[str]:
        """This timeline's automatic boundaries, oldest first."""
        return self.steps.names

    # -- capsule section of the engine itself: frame and latest observation --------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return observation_tensors(self._obs, self.model.device)

    def state_meta(self) -> dict:
        obs = observation_meta(self._obs)
        return {"frame": self.frame, "instruction": self.instruction, "observation": obs}

    def check_state(self, tensors: dict, meta: dict) -> None:
        int(meta["frame"])
        if not isinstance(meta["instruction"], str):
            raise ValueError("engine section: instruction is not text")
        check_observation(self.model.cfg, tensors, meta["observation"])

    def load_state(self, tensors: dict, meta: dict) -> None:
        self.frame = int(meta["frame"])
        self.instruction = meta["instruction"]
        self._obs = load_observation(tensors, meta["observation"])
