"""OxyGen's concurrent baseline: the action task and the language task as separate OS
processes sharing the device, each with its own copy of the model and its own prefill.

    action process    per frame: prefill -> 10 denoise steps -> chunk
    language process  per frame: prefill -> narration of `tokens` tokens, decoded alone

Both start a round together (a barrier) and run the same frames as fast as they can;
the OS (or the GPU's time slicing) interleaves them. Spawned once per benchmark and
driven round by round through queues, so their start-up is not timed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
from dataclasses import dataclass

import torch

from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model
from embodied_kv.timing import device_clock

START_TIMEOUT_S = 300.0  # a child builds a model before its first round (slow when loaded)


def observations(cfg, frames: int):
    """The observation stream every oxygen mode sees."""
    return [
        synthetic_observation(cfg, i, f"task {i % 4}: put the block in the bowl")
        for i in range(frames)
    ]


def _worker(role: str, preset: str, device: str, threads: int, max_len: int, barrier, cmds, out):
    torch.set_num_threads(threads)
    model = build_model(get_preset(preset), device)
    clock = device_clock(device)
    manager = KVCacheManager(model, 2, max_len)
    out.put(("ready", role))
    while (cmd := cmds.get()) is not None:
        tokens, frames, warmup, seed = cmd
        obs = observations(model.cfg, frames)
        barrier.wait()
        t_start, per_frame, texts, n_tok = None, [], {}, 0
        with torch.no_grad():
            for f, o in enumerate(obs):
                if f == warmup:
                    t_start = clock()
                t = clock()
                fp = manager.prefill_frame(f, model.embed_prefix(o))
                if role == "action":
                    model.sample_actions(
                        manager.arena, fp.slot, fp.prefix_len, model.make_noise(seed + f)
                    )
                    manager.end_frame(fp)
                else:
                    req = manager.create(fp, f"narration-{f}", TaskKind.NARRATION, tokens)
                    while not req.done:
                        manager.decode_step()
                    texts[req.request_id] = model.tokenizer.decode(req.tokens)
                    if f >= warmup:
                        n_tok += len(req.tokens)
                    manager.release(req)
                if f >= warmup:
                    per_frame.append(clock() - t)
        out.put(
            (
                role,
                {
                    "frame_s": per_frame,
                    "wall_s": clock() - t_start,
                    "tokens": n_tok,
                    "texts": texts,
                },
            )
        )


@dataclass
class ConcurrentTasks:
    """Two spawned processes (action, language) and the queues that drive them."""

    procs: list
    cmds: dict
    out: object

    @classmethod
    def start(cls, preset: str, device: str, threads: int, max_len: int) -> ConcurrentTasks:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch state
        barrier, out = ctx.Barrier(2), ctx.Queue()
        cmds = {role: ctx.Queue() for role in ("action", "language")}
        procs = [
            ctx.Process(
                target=_worker,
                args=(role, preset, device, threads, max_len, barrier, cmds[role], out),
                daemon=True,
            )
            for role in cmds
        ]
        for p in procs:
            p.start()
        self = cls(procs, cmds, out)
        ready = {self._get(START_TIMEOUT_S)[1] for _ in procs}
        assert ready == {"action", "language"}
        return self

    def _get(self, timeout: float):
        try:
            return self.out.get(timeout=timeout)
        except queue_mod.Empty:
            self.stop()
            raise RuntimeError(f"concurrent task processes gave no result in {timeout} s") from None

    def run(self, tokens: int, frames: int, warmup: int, seed: int) -> dict:
        """One round: both processes run `frames` frames at once -> results per role."""
        for q in self.cmds.values():
            q.put((tokens, frames, warmup, seed))
        return dict(self._get(START_TIMEOUT_S) for _ in self.procs)

    def stop(self) -> None:
        for q in self.cmds.values():
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
