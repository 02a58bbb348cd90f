"""The four single-process modes `bench oxygen` compares, one interface (`cycle`).

OxyGen has two mechanisms; each mode switches them on or off:

    mode            prefills per frame           language decode
    isolated        1 + 1 per request            each request alone, to its end, in its frame
    sharing_only    1 (requests adopt the slot)  each request alone, to its end, in its frame
    batching_only   1 + 1 per request            all live requests of all frames in one step,
                                                 `max_decode_steps` steps per cycle
    unified         1 (requests adopt the slot)  all live requests in one step (both)

`isolated` is the engine's IsolatedRunner and `unified` its FrameLoop (the product code);
the two ablations reuse the same manager and step here. The concurrent-processes
baseline (separate OS processes sharing the device) is bench/oxygen_procs.py.
"""

from __future__ import annotations

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.frame_loop import CycleResult, FrameLoop, TextEvent
from embodied_kv.engine.isolated import IsolatedRunner
from embodied_kv.engine.policy import LanguagePolicy, LoopConfig
from embodied_kv.kv.manager import KVCacheManager
from embodied_kv.model.action_space import identity_io
from embodied_kv.timing import device_clock

MODES = ("isolated", "sharing_only", "batching_only", "unified")


class AblationRunner:
    """One mechanism on: `share` (requests continue the action's prefill) xor `batch`
    (requests decode together across frames)."""

    def __init__(self, model, queue, cfg: LoopConfig, num_slots: int, max_len: int, share, batch):
        self.model, self.queue, self.cfg = model, queue, cfg
        self.share, self.batch = share, batch
        self.manager = KVCacheManager(model, num_slots, max_len)
        self.policy = LanguagePolicy(cfg)
        self.clock = device_clock(model.device)
        self.robot = identity_io(model.cfg.state_dim, model.cfg.action_dim)  # as FrameLoop

    def cycle(self, obs, frame: int, tick: int) -> CycleResult:
        m, model = self.manager, self.model
        t0 = self.clock()
        fp = m.prefill_frame(frame, model.embed_prefix(obs))
        t_prefill = self.clock()
        noise = model.make_noise(self.cfg.seed + frame)
        chunk = model.sample_actions(m.arena, fp.slot, fp.prefix_len, noise)
        chunk = self.robot.actions_out(chunk.float().cpu().numpy(), obs.robot_state)
        self.queue.push(chunk, tick)
        t_action = self.clock()
        for task in self.policy.tasks_for(frame):
            own = fp if self.share else m.prefill_frame(frame, model.embed_prefix(obs))
            suffix = model.tokenizer.encode(task.suffix, bos=False) if task.suffix else None
            m.create(own, task.request_id, task.kind, task.max_new_tokens, suffix)
            if own is not fp:
                m.end_frame(own)
        m.end_frame(fp)
        steps = 0
        while m.live() and (not self.batch or steps < self.cfg.max_decode_steps):
            m.decode_step()
            steps += 1
        events = [self._done(r) for r in list(m.requests.values()) if r.done]
        return CycleResult(
            frame,
            chunk,
            fp.prefix_len,
            t_prefill - t0,
            t_action - t0,
            steps,
            self.clock() - t0,
            events,
        )

    def _done(self, req) -> TextEvent:
        text = self.model.tokenizer.decode(req.tokens)
        self.manager.release(req)
        return TextEvent(req.request_id, req.kind, req.frame, text, text, True, req.truncated)

    def finish_all(self) -> list[TextEvent]:
        while self.manager.live():
            self.manager.decode_step()
        return [self._done(r) for r in list(self.manager.requests.values())]


def make_runner(mode: str, model, cfg: LoopConfig, inflight: int, max_len: int):
    """A fresh runner of `mode` with its own arena; `inflight` requests overlap at most."""
    queue = ActionQueue(model.cfg.action_horizon, model.cfg.action_dim)
    slots = inflight + 2
    if mode == "isolated":
        return IsolatedRunner(model, queue, cfg, max_len)
    if mode == "unified":
        return FrameLoop(KVCacheManager(model, slots, max_len), queue, cfg)
    if mode == "sharing_only":
        return AblationRunner(model, queue, cfg, 2, max_len, share=True, batch=False)
    if mode == "batching_only":
        return AblationRunner(model, queue, cfg, slots + 1, max_len, share=False, batch=True)
    raise ValueError(f"unknown mode {mode!r}; known: {MODES}")
