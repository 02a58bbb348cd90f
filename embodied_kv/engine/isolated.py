"""Isolated execution: the baseline OxyGen is measured against.

Every task prefills the observation for itself and runs alone, one after another:
the action expert on its own prefill, then each language task on another prefill of
the same observation, decoded to completion before the next cycle. Same model,
weights, inputs and policy as the unified loop.
"""

from __future__ import annotations

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.frame_loop import CycleResult, TextEvent
from embodied_kv.engine.policy import LanguagePolicy, LoopConfig
from embodied_kv.kv.manager import KVCacheManager
from embodied_kv.model.action_space import RobotIO, identity_io
from embodied_kv.model.vla import VLA, Observation
from embodied_kv.timing import device_clock


class IsolatedRunner:
    def __init__(
        self,
        model: VLA,
        queue: ActionQueue,
        cfg: LoopConfig,
        max_len: int,
        policy: LanguagePolicy | None = None,
        clock=None,
        robot: RobotIO | None = None,
    ):
        self.model, self.queue, self.cfg = model, queue, cfg
        self.clock = clock or device_clock(model.device)  # synchronizes on CUDA
        c = model.cfg
        self.robot = robot or identity_io(c.state_dim, c.action_dim)  # as FrameLoop
        self.manager = KVCacheManager(model, num_slots=2, max_len=max_len)
        self.policy = policy or LanguagePolicy(cfg)

    def cycle(self, obs: Observation, frame: int, tick: int) -> CycleResult:
        t0 = self.clock()
        m = self.manager

        # action task: its own prefill
        fp = m.prefill_frame(frame, self.model.embed_prefix(obs))
        t_prefill = self.clock()
        noise = self.model.make_noise(self.cfg.seed + frame)
        chunk = self.model.sample_actions(m.arena, fp.slot, fp.prefix_len, noise)
        chunk = self.robot.actions_out(chunk.float().cpu().numpy(), obs.robot_state)
        self.queue.push(chunk, tick)
        t_action = self.clock()
        m.end_frame(fp)

        # each language task: its own prefill, decoded alone to the end
        events, steps = [], 0
        for task in self.policy.tasks_for(frame):
            own = m.prefill_frame(frame, self.model.embed_prefix(obs))
            suffix = self.model.tokenizer.encode(task.suffix, bos=False) if task.suffix else None
            req = m.create(own, task.request_id, task.kind, task.max_new_tokens, suffix)
            while not req.done:
                m.decode_step()
                steps += 1
            tok = self.model.tokenizer
            text = tok.decode(req.tokens)
            events.append(
                TextEvent(req.request_id, req.kind, frame, text, text, True, req.truncated)
            )
            m.release(req)
        t_end = self.clock()
        return CycleResult(
            frame, chunk, fp.prefix_len, t_prefill - t0, t_action - t0, steps, t_end - t0, events
        )
