"""CUDA graphs over the arena (FlashRT): capture once, replay with new inputs.

Every buffer the graphs touch has a fixed address (the arena, the static inputs
below), so a capsule restore, which copies into the arena, needs no recapture.

* packed steps (decode, mixed, prefill): one graph per token bucket in STEP_BUCKETS;
  a step is padded to the smallest bucket that holds it (padding writes the scratch
  slot), its plan copied into the static inputs, the graph replayed.
* denoising: the whole 10-step Euler loop as one graph per (slot, row bucket); the
  expert reads rows [0, bucket) and masks those past the prefix length.

On a CPU the model runs eagerly: `GraphRunner.enabled` is False and every call
returns None, which sends the caller down the eager path.
"""

from __future__ import annotations

import torch

from embodied_kv.kv.arena import KVArena
from embodied_kv.kv.step import PackedStep, Segment, commit_step, plan_step
from embodied_kv.model.vla import VLA, StepInput

STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)  # tokens per packed step
DENOISE_BUCKETS = (256, 512, 1024, 2048)  # prefix rows the action expert reads
WARMUP_ITERS = 2  # eager runs on a side stream before capture (Triton compiles, cuBLAS plans)


class StaticStep:
    """The inputs of one packed-step graph, at fixed addresses."""

    def __init__(self, model: VLA, arena: KVArena, n: int):
        dev, L = arena.device, arena.spec.num_layers
        self.n = n
        self.x = torch.zeros(n, model.cfg.backbone.width, device=dev, dtype=model.dtype)
        self.slot = torch.full((n,), arena.scratch_slot, device=dev, dtype=torch.int64)
        self.position = torch.zeros(n, device=dev, dtype=torch.int64)
        self.row = torch.arange(n, device=dev).repeat(L, 1)  # [L, n]
        self.kv_len = self.row + 1
        self.plan = PackedStep((), n, self.slot, self.position, self.row, self.kv_len, None, [], [])
        self.logits: torch.Tensor | None = None  # [n, V] fp32, the graph's output
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, plan: PackedStep, x: torch.Tensor) -> None:
        self.x.copy_(x, non_blocking=True)
        self.slot.copy_(plan.slot, non_blocking=True)
        self.position.copy_(plan.position, non_blocking=True)
        self.row.copy_(plan.row, non_blocking=True)
        self.kv_len.copy_(plan.kv_len, non_blocking=True)


class GraphRunner:
    def __init__(
        self,
        model: VLA,
        arena: KVArena,
        step_buckets=STEP_BUCKETS,
        denoise_buckets=DENOISE_BUCKETS,
    ):
        self.model, self.arena = model, arena
        self.enabled = arena.device.type == "cuda"
        limit = arena.spec.max_len
        self.step_buckets = tuple(b for b in step_buckets if b <= limit)
        self.denoise_buckets = tuple(b for b in denoise_buckets if b <= limit)
        self._steps: dict[int, StaticStep] = {}
        self._denoise: dict[tuple[int, int], tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.replays = 0

    # -- packed step -----------------------------------------------------------------

    @torch.no_grad()
    def capture_steps(self) -> None:
        for n in self.step_buckets:
            self._step_graph(n)

    def _step_graph(self, n: int) -> StaticStep:
        if n in self._steps:
            return self._steps[n]
        st = StaticStep(self.model, self.arena, n)
        bb = self.model.backbone

        def fwd():
            hidden = bb(st.x, st.plan, self.arena)
            return (hidden @ bb.embed_tokens.weight.t()).float()

        st.graph, st.logits = self._capture(fwd)
        self._steps[n] = st
        return st

    @torch.no_grad()
    def step(self, inputs: list[StepInput]) -> torch.Tensor | None:
        """Replay the packed step; logits [len(inputs), V], or None (eager instead)."""
        if not self.enabled:
            return None
        n = sum(i.n for i in inputs)
        size = next((b for b in self.step_buckets if b >= n), None)
        if size is None:
            return None
        st = self._step_graph(size)
        plan = plan_step(self.arena, [Segment(i.slot, i.n, i.causal) for i in inputs], size)
        st.load(plan, self.model.embed_inputs(inputs, size))
        st.graph.replay()
        self.replays += 1
        commit_step(self.arena, plan)
        return st.logits[plan.last]

    # -- denoising -------------------------------------------------------------------

    @torch.no_grad()
    def sample_actions(self, slot: int, prefix_len: int, noise: torch.Tensor):
        """Replay the Euler loop for (slot, bucket); None if no bucket holds the prefix."""
        if not self.enabled:
            return None
        rows = next((b for b in self.denoise_buckets if b >= prefix_len), None)
        if rows is None:
            return None
        key = (slot, rows)
        if key not in self._denoise:
            dev = self.arena.device
            noise_s = torch.zeros_like(noise)
            plen_s = torch.zeros((), dtype=torch.int64, device=dev)
            expert = self.model.expert
            graph, out = self._capture(
                lambda: expert.sample(self.arena, slot, plen_s, noise_s, rows)
            )
            self._denoise[key] = (graph, out, noise_s, plen_s)
        graph, out, noise_s, plen_s = self._denoise[key]
        noise_s.copy_(noise, non_blocking=True)
        plen_s.fill_(prefix_len)
        graph.replay()
        self.replays += 1
        return out.clone()

    # -- capture ---------------------------------------------------------------------

    @torch.no_grad()
    def _capture(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out
