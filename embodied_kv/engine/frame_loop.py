"""One control cycle of the unified engine (OxyGen): prefill once, act on time, then
decode every live language request together for the time that is left."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.admission import admit
from embodied_kv.engine.events import TextEvent
from embodied_kv.engine.noise_ahead import NoiseAhead
from embodied_kv.engine.policy import LanguagePolicy, LoopConfig
from embodied_kv.engine.rtc_guide import ChunkGuide
from embodied_kv.kv.manager import KVCacheManager, Request, Status, TaskKind
from embodied_kv.model.action_space import RobotIO, identity_io
from embodied_kv.model.vla import Observation
from embodied_kv.timing import Stopwatch, device_clock


@dataclass
class CycleResult:
    frame: int
    chunk: np.ndarray | None  # [H, robot action_dim] robot units; None: ar filling, or held
    prefix_len: int
    prefill_s: float
    action_s: float  # prefill start -> chunk in the queue
    decode_steps: int
    cycle_s: float
    events: list[TextEvent] = field(default_factory=list)
    chunk_tick: int | None = None  # tick the chunk starts at, when not the cycle's (`ar` mode)


@dataclass
class LoopCounters:
    cycles: int = 0
    action_late: int = 0  # chunk ready after the cycle's deadline
    overruns: int = 0  # cycle ended after its deadline
    decode_deferred: int = 0  # cycles that stopped decoding with requests still live
    # persistent launches whose bounded wait ran out (kernels/work_queue.py: their outputs
    # were wrong), read every WAIT_CHECK_CYCLES cycles where the chunk's copy has synced
    wait_timeouts: int = 0


WAIT_CHECK_CYCLES = 50


STARVE_CYCLES = 2  # cycles in a row without a decode step before one runs regardless


class StepCost:
    """Moving estimate of one batched decode step (s), per batch size seen."""

    def __init__(self, ema: float):
        self.ema = ema
        self._by_batch: dict[int, float] = {}

    def estimate(self, batch: int) -> float | None:
        if batch in self._by_batch:
            return self._by_batch[batch]
        known = [v for b, v in self._by_batch.items() if b >= batch]
        return min(known) if known else (max(self._by_batch.values()) if self._by_batch else None)

    def update(self, batch: int, seconds: float) -> None:
        old = self._by_batch.get(batch)
        self._by_batch[batch] = (
            seconds if old is None else (1 - self.ema) * old + self.ema * seconds
        )


class FrameLoop:
    def __init__(
        self,
        manager: KVCacheManager,
        queue: ActionQueue,
        cfg: LoopConfig,
        policy: LanguagePolicy | None = None,
        clock=None,
        robot: RobotIO | None = None,
        rtc: ChunkGuide | None = None,
    ):
        self.manager, self.queue, self.cfg = manager, queue, cfg
        self.rtc = rtc  # real-time chunking (engine/rtc_guide.py); None: plain chunks
        self.model = manager.model
        c = self.model.cfg
        self.robot = robot or identity_io(c.state_dim, c.action_dim)  # model units -> robot
        self.policy = policy or LanguagePolicy(cfg)
        # every timed region waits for the device's queued work (embodied_kv/timing.py)
        self.clock = clock or device_clock(self.model.device)  # also sets self.watch
        self.noise = NoiseAhead(c.action_horizon, c.action_dim, self.model.device)
        # the next frame's noise is drawn at the end of a cycle; False: by the caller, when
        # it has sent the chunk on (Engine.draw_noise_ahead: `embodied-kv serve`)
        self.draw_ahead = True
        self.cost = StepCost(cfg.cost_ema)
        self.counters = LoopCounters()
        self._starved = 0  # cycles in a row that decoded nothing while requests were live
        self.planner = None  # engine/plan_memory.py MemoryPlanner in `keep` mode

    @property
    def clock(self):
        return self._clock

    @clock.setter
    def clock(self, clock) -> None:
        self._clock = clock
        # prefill -> denoise without a device sync between them (CUDA events)
        self.watch = Stopwatch(self.model.device, clock)

    def cycle(self, obs: Observation, frame: int, tick: int) -> CycleResult:
        """Frame `frame`, observed at control tick `tick`: its chunk covers tick.. on."""
        cfg, manager = self.cfg, self.manager
        t0 = self.watch.start()  # the cycle's boundary: nothing of this cycle queued yet
        deadline = t0 + cfg.period_s

        # (a) the one prefill of this observation
        fp = manager.prefill_frame(frame, self.model.embed_prefix(obs))
        prefilled = self.watch.mark()  # no sync: the denoise queues right behind it

        try:
            # (b) the action expert reads the same slot: the hard deadline; its noise was
            # drawn after the last chunk (engine/noise_ahead.py), make_noise's bytes
            noise = self.noise.take(cfg.seed + frame)
            guide = self.rtc.guide(self.queue, tick) if self.rtc is not None else None
            chunk = self.model.sample_actions(
                manager.arena, fp.slot, fp.prefix_len, noise, fp.compressed, guide,
                self.rtc.cfg if guide is not None else None,
            )  # fmt: skip
            model_chunk = chunk.float().cpu().numpy()  # [H, A_model] normalised
            chunk = self.robot.actions_out(model_chunk, obs.robot_state)
            # RTC holds the next chunk to this one (model units) unless its observation
            # predates its instruction: a plan made from the scene before the task was given
            plan = self.rtc is not None
            if plan and not obs.after_instruction:
                self.rtc.counters.stale_observations += 1
                plan = False
            self.queue.push(chunk, tick, model_chunk if plan else None)
            t_action = self.clock()
            self.counters.action_late += int(t_action > deadline)
            if self.counters.cycles % WAIT_CHECK_CYCLES == 0:  # the device is idle here
                self.counters.wait_timeouts = self.model.expert.workspaces.timed_out()
            prefill_s = self.watch.seconds(prefilled)  # the device is done with it by now
            if self.draw_ahead:
                self.noise.draw(cfg.seed + frame + 1)  # the next frame's, off the action path

            # language tasks of this frame continue from the same prefix (admission.py)
            events = admit(manager, self.policy, fp, self.model.tokenizer, self.planner)
        finally:
            manager.end_frame(fp)  # also when the cycle fails: the frame slot never leaks

        # (c) batched decode for the time that is left
        steps = self._decode_until(deadline)

        # (d) text out; finished slots back to the arena
        events += self._emit()
        t_end = self.clock()
        self.counters.cycles += 1
        self.counters.overruns += int(t_end > deadline)
        return CycleResult(
            frame, chunk, fp.prefix_len, prefill_s, t_action - t0, steps, t_end - t0, events
        )

    def _decode_until(self, deadline: float) -> int:
        steps, cap = 0, self.cfg.max_decode_steps
        # One slow step (a load spike) must not stop language for good: its estimate only
        # changes when a step runs, so after STARVE_CYCLES cycles without one, one runs.
        starving = self._starved >= STARVE_CYCLES
        while self.manager.live() and not (cap and steps >= cap):
            batch = len(self.manager.live())
            est = self.cost.estimate(batch)
            left = deadline - self.clock() - self.cfg.decode_margin_s
            # no estimate yet: risk one step only with more than half the period left
            if left <= (est if est is not None else self.cfg.period_s / 2) and not (
                starving and steps == 0
            ):
                self.counters.decode_deferred += 1
                break
            t = self.clock()
            self.manager.decode_step()
            self.cost.update(batch, self.clock() - t)
            steps += 1
        self._starved = self._starved + 1 if self.manager.live() and not steps else 0
        return steps

    def _emit(self) -> list[TextEvent]:
        events = []
        for req in list(self.manager.requests.values()):
            if len(req.tokens) > req.emitted or req.done:
                events.append(self._event(req))
            if req.done:
                self.manager.release(req)
        return events

    def _event(self, req: Request) -> TextEvent:
        tok = self.model.tokenizer
        new = tok.decode(req.tokens[req.emitted :])
        req.emitted = len(req.tokens)
        return TextEvent(
            req.request_id,
            req.kind,
            req.frame,
            tok.decode(req.tokens),
            new,
            req.done,
            req.truncated,
            Status.TRUNCATED if req.truncated else Status.OK,
            req.reason,
        )

    def warmup(self, obs: Observation) -> None:
        """Run the cycle's work once without a deadline (first-call costs, and the decode
        estimate before the first real deadline); leaves no request and no counts."""
        m = self.manager
        fp = m.prefill_frame(-1, self.model.embed_prefix(obs))
        noise = self.model.make_noise(0)
        self.model.sample_actions(m.arena, fp.slot, fp.prefix_len, noise, fp.compressed)
        req = m.create(fp, "__warmup__", TaskKind.NARRATION, max_new_tokens=4)
        for _ in range(3):
            if req.done:
                break
            t = self.clock()
            m.decode_step()
            self.cost.update(1, self.clock() - t)
        m.release(req)
        m.counters = type(m.counters)()

    def finish_all(self, max_steps: int = 100_000) -> list[TextEvent]:
        """Decode every live request to its end without a deadline (shutdown, tests)."""
        events = []
        for _ in range(max_steps):
            if not self.manager.live():
                break
            self.manager.decode_step()
            events += self._emit()
        return events + self._emit()
