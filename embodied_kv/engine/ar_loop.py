"""The control cycle of the `ar` action mode: one packed step for everything.

    cycle c:  | prefill frame c | action decode of frames c-1 .. c-K+1 | language decodes |
              '-------------------------- one packed step -------------------------------'

The action tokens are pipelined by ActionFlow (engine/pipeline.py) over a ring of
arena slots; the live language requests of the unified manager (OxyGen) join the same
step, one token each. A language task of frame c gets a byte copy of its prefix (the
ring slot goes on with action tokens). With `unified=False` the language decode runs
as a separate step after it: the same tokens, one more step per cycle (the baseline
`bench actionflow` compares against).
"""

from __future__ import annotations

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.admission import admit
from embodied_kv.engine.frame_loop import CycleResult, FrameLoop
from embodied_kv.engine.pipeline import ActionFlow
from embodied_kv.engine.policy import LanguagePolicy, LoopConfig
from embodied_kv.kv.manager import FramePrefix, KVCacheManager
from embodied_kv.model.action_space import RobotIO
from embodied_kv.model.action_tokens import ActionTokenizer
from embodied_kv.model.vla import Observation


class ARLoop(FrameLoop):
    def __init__(
        self,
        manager: KVCacheManager,
        queue: ActionQueue,
        cfg: LoopConfig,
        tokenizer: ActionTokenizer,
        unified: bool = True,
        policy: LanguagePolicy | None = None,
        clock=None,
        robot: RobotIO | None = None,
    ):
        super().__init__(manager, queue, cfg, policy, clock, robot)
        if (queue.horizon, queue.action_dim) != (tokenizer.horizon, self.robot.action_dim):
            raise ValueError(
                f"queue ({queue.horizon}, {queue.action_dim}) != (action tokens' horizon "
                f"{tokenizer.horizon}, robot action_dim {self.robot.action_dim})"
            )
        self.flow = ActionFlow(self.model, manager.arena, tokenizer)
        self.unified = unified

    def cycle(self, obs: Observation, frame: int, tick: int) -> CycleResult:
        """Frame `frame` observed at `tick` enters; the actions that complete go to the
        queue stamped with their own observation's tick."""
        manager = self.manager
        t0 = self.clock()
        deadline = t0 + self.cfg.period_s
        prefix = self.model.embed_prefix(obs)
        slot = self.flow.next_slot

        # the one packed step: prefill + action decodes (+ language decodes)
        live = manager.live() if self.unified else []
        state = obs.robot_state  # kept with the frame: delta actions add it back
        out = self.flow.cycle(prefix, frame, tick, manager.batch() if live else None, state)
        if live:
            manager.advance(live, out.extra_logits)
        steps = int(bool(live))
        chunks = [self.robot.actions_out(d.chunk, d.state) for d in out.done]  # robot units
        for d, chunk in zip(out.done, chunks, strict=True):
            self.queue.push(chunk, d.tick)
        t_step = self.clock()
        self.counters.action_late += sum(int(t_step > deadline) for _ in out.done)

        manager.counters.frames += 1
        manager.counters.prompts_truncated += int(prefix.prompt_truncated)
        p = prefix.embeds.shape[0]
        fp = FramePrefix(frame, slot, p, out.prefix_logits, prefix.prompt_truncated, adopted=True)
        refused = admit(manager, self.policy, fp, self.model.tokenizer, self.planner)  # whole
        if not self.unified and manager.live():
            manager.decode_step()  # the separate-steps baseline
            steps += 1

        events = refused + self._emit()
        t_end = self.clock()
        self.counters.cycles += 1
        self.counters.overruns += int(t_end > deadline)
        last = out.done[-1] if out.done else None
        return CycleResult(
            last.frame if last else frame,
            chunks[-1] if last else None,
            p,
            t_step - t0,
            last.latency_s if last else t_step - t0,  # its observation -> its action (~K cycles)
            steps,
            t_end - t0,
            events,
            chunk_tick=last.tick if last else None,
        )

    def warmup(self, obs: Observation) -> None:
        """One frame through the whole pipeline without a deadline; leaves no state."""
        prefix = self.model.embed_prefix(obs)
        self.flow.cycle(prefix, -1, 0)
        self.flow.drain()
        self.flow.reserve()
        self.flow.counters = type(self.flow.counters)()
        self.flow.dec.tok.counters = type(self.flow.dec.tok.counters)()
