"""Graphs over the arena (FlashRT): capture once, replay with new inputs.

Every buffer the graphs touch has a fixed address (the arena, the static inputs
below), so a capsule restore, which copies into the arena, needs no recapture.

* packed steps (decode, mixed, prefill): one graph per token bucket in STEP_BUCKETS;
  a step is padded to the smallest bucket that holds it (padding writes the scratch
  slot), its plan copied into the static inputs, the graph replayed. The LM head runs
  inside the graph on one row per segment only: [logit_rows, V], not [bucket, V].
* denoising: the whole 10-step Euler loop as one graph per (slot, row bucket); the
  expert reads rows [0, bucket) and masks those past the prefix length (a device
  scalar), exactly as the eager path does (model/vla.py `denoise_rows`).
* RTC (model/rtc.py): the guided Euler loop, its VJP through the expert included, as one
  graph per (slot, row bucket, guidance, beta); the previous chunk and W are static inputs.
* vision: the SigLIP tower and projector as one graph per number of present cameras
  (1 .. num_cameras): the images copied into a static input, the image tokens read from
  the static output (at pi05 ~570 kernels per frame, launch-bound when eager).

Modes:
  "cuda"     torch.cuda.graph capture and replay (the product).
  "emulate"  everything but the CUDA call, on the CPU: the same static buffers, the
             same plan copies, the same bucketed functions. Capture records the tensor
             ops the function runs over those buffers (engine/graph_emulation.py); replay
             reruns them. Like a CUDA capture, that freezes every host-side value (a
             Python int, a list, a host tensor's contents) and refuses reading a tensor's
             value on the host, so CPU tests catch what would break a replay. CPU only:
             on CUDA the Triton kernels (RoPE, RMSNorm, GELU gate) launch outside torch's
             dispatcher, so a recording would keep their outputs' allocation and not the
             kernel, and a replay would read memory nobody wrote.
  "off"      no graphs: every call returns None and the caller runs eagerly (the CPU
             default in production).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embodied_kv.engine.graph_emulation import record
from embodied_kv.kernels.packed_attention import row_bucket
from embodied_kv.model.rtc import sample_guided
from embodied_kv.model.vla import VLA, StepInput, denoise_rows
from embodied_kv.storage.arena import KVArena
from embodied_kv.storage.step import PackedStep, Segment, commit_step, logit_rows, plan_step

# tokens per packed step; every 64 from 512 to 1024, where pi05 prefixes fall (2 cameras +
# text ~560, 3 ~820): a 560-token prefill padded to 1024 ran +80 % GEMM FLOPs (bench estimate)
STEP_BUCKETS = (16, 32, 64, 128, 256, 512, *range(576, 1025, 64), 2048)
WARMUP_ITERS = 2  # eager runs on a side stream before capture (Triton compiles, cuBLAS plans)
MODES = ("cuda", "emulate", "off")


def default_mode(device: torch.device | str) -> str:
    """CUDA graphs on a CUDA device, none elsewhere (emulation is chosen explicitly)."""
    return "cuda" if torch.device(device).type == "cuda" else "off"


class StaticStep:
    """The inputs and output of one packed-step graph, at fixed addresses.

    The plan holds device tensors only (`runs`, `kv_len_host` None): nothing host-side
    may reach the captured function, whose host values would be frozen at capture."""

    def __init__(self, model: VLA, arena: KVArena, n: int):
        dev, L, T = arena.device, arena.spec.num_layers, arena.spec.max_len
        self.n = n
        self.x = torch.zeros(n, model.cfg.backbone.width, device=dev, dtype=model.dtype)
        self.slot = torch.full((n,), arena.scratch_slot, device=dev, dtype=torch.int64)
        self.position = torch.zeros(n, device=dev, dtype=torch.int64)
        self.row = (torch.arange(n, device=dev) % T).repeat(L, 1)  # [L, n] scratch rows
        self.kv_len = self.row + 1  # [L, n]
        self.last_index = torch.zeros(logit_rows(arena), device=dev, dtype=torch.int64)
        self.plan = PackedStep(
            (), n, self.slot, self.position, self.row, self.kv_len, None, None, [],
            self.last_index,
        )  # fmt: skip
        # [logit_rows, W] the graph's output: the rows the LM head reads. The head runs
        # after the replay (VLA.step), or later for a frame's prefill (model/lazy_logits.py)
        self.rows: torch.Tensor | None = None
        self.replay: Callable[[], None] | None = None

    def load(self, plan: PackedStep, x: torch.Tensor) -> None:
        """Device-to-device copies of a plan (already on the device, see storage/step.py)."""
        self.x.copy_(x, non_blocking=True)
        self.slot.copy_(plan.slot, non_blocking=True)
        self.position.copy_(plan.position, non_blocking=True)
        self.row.copy_(plan.row, non_blocking=True)
        self.kv_len.copy_(plan.kv_len, non_blocking=True)
        self.last_index.copy_(plan.last_index, non_blocking=True)


class GraphRunner:
    def __init__(
        self,
        model: VLA,
        arena: KVArena,
        mode: str | None = None,
        step_buckets=STEP_BUCKETS,
    ):
        mode = default_mode(arena.device) if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"graph mode {mode!r}: expected one of {MODES}")
        if mode == "cuda" and arena.device.type != "cuda":
            raise ValueError(f"graph mode 'cuda' needs a CUDA arena, got {arena.device}")
        if mode == "emulate" and arena.device.type != "cpu":
            raise ValueError(f"graph mode 'emulate' runs on the CPU (its recording misses "
                             f"the Triton kernels), got a {arena.device} arena: use 'cuda'")
        self.model, self.arena, self.mode = model, arena, mode
        self.enabled = mode != "off"
        # a bucket b serves n tokens when its padding b - n fits the scratch slot (max_len
        # rows) and n fits the slots: b <= (num_slots + 1) * max_len. plan_step pads every
        # step to a multiple of the arena's row bucket (on the CPU the host's probe, 32 on
        # the H100 machine's Xeon; on CUDA 8), so only multiples of it can hold a step.
        most = (arena.spec.num_slots + 1) * arena.spec.max_len
        size = row_bucket(arena.device)
        self.step_buckets = tuple(b for b in step_buckets if b <= most and b % size == 0)
        self._steps: dict[int, StaticStep] = {}
        self._denoise: dict[tuple[int, int], tuple] = {}
        self._guided: dict[tuple, tuple] = {}  # (slot, rows, guidance, beta): RTC's loop
        self._vision: dict[int, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.replays = 0
        self.captures = 0

    def capture(self, rtc=None) -> None:
        """Capture every step bucket, the denoise loop of every slot and row bucket and the
        vision tower at every camera count (configure time; nothing is captured during a
        control cycle after this)."""
        self.capture_steps()
        for cams in range(1, self.model.cfg.num_cameras + 1):
            self._vision_graph(cams)
        spec = self.arena.spec
        # the expert reads a frame's fresh prefix: at most all cameras + the prompt
        longest = min(spec.max_len, self.model.cfg.prefix_tokens_max)
        rows = sorted({denoise_rows(p, spec.max_len) for p in range(1, longest + 1)})
        for slot in range(spec.num_slots):
            for r in rows:
                self._denoise_graph(slot, r)
                if rtc is not None and rtc.enabled:
                    self._guided_graph(slot, r, rtc)

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
            hidden = bb(st.x, st.plan, self.arena)  # [n, W]
            return bb.head_rows(hidden, st.last_index)  # [logit_rows, W]

        st.replay, st.rows = self.graph_of(fwd)
        self._steps[n] = st
        return st

    def bucket(self, n: int) -> int | None:
        """The step bucket for n tokens: the smallest that holds them with its padding
        within the scratch slot; None if none does."""
        limit = self.arena.spec.max_len
        # every bucket is a row-bucket multiple: b >= n is b >= what plan_step pads n to
        return next((b for b in self.step_buckets if n <= b <= n + limit), None)

    @torch.no_grad()
    def step(self, inputs: list[StepInput]) -> torch.Tensor | None:
        """Replay the packed step; logits [len(inputs), V] on the device, or None (no
        bucket holds the step, or graphs are off: eager instead)."""
        rows = self._replay(inputs)  # the static buffer: the head reads it before any replay
        return None if rows is None else self.model.backbone.head(rows)[: len(inputs)]

    @torch.no_grad()
    def step_rows(self, inputs: list[StepInput]) -> torch.Tensor | None:
        """Replay the packed step without its LM head -> the rows the head reads
        [logit_rows, W] (a copy), or None as `step`."""
        rows = self._replay(inputs)
        # a copy: the static buffer is overwritten by the next replay of this bucket
        return None if rows is None else rows.clone()

    def _replay(self, inputs: list[StepInput]) -> torch.Tensor | None:
        if not self.enabled or not inputs:
            return None
        size = self.bucket(sum(i.n for i in inputs))
        if size is None:
            return None
        st = self._step_graph(size)
        plan = plan_step(self.arena, [Segment(i.slot, i.n, i.causal) for i in inputs], size)
        st.load(plan, self.model.embed_inputs(inputs, size))
        st.replay()
        self.replays += 1
        commit_step(self.arena, plan)
        return st.rows  # [logit_rows, W] static

    # -- denoising -------------------------------------------------------------------

    @torch.no_grad()
    def sample_actions(self, slot: int, prefix_len: int, noise: torch.Tensor):
        """Replay the Euler loop for (slot, row bucket) -> chunk [H, A]; None when off."""
        if not self.enabled:
            return None
        rows = denoise_rows(prefix_len, self.arena.spec.max_len)
        replay, out, noise_s, plen_s = self._denoise_graph(slot, rows)
        self._refresh_constants()
        noise_s.copy_(noise, non_blocking=True)
        plen_s.fill_(prefix_len)
        replay()
        self.replays += 1
        return out.clone()

    def _refresh_constants(self) -> None:
        """The flow-time modulation the denoise graphs read (model/flow_constants.py),
        recomputed in place if the weights changed since (a host-side check)."""
        self.model.expert.flow_mods.refresh_all(self.model.expert)

    def _denoise_graph(self, slot: int, rows: int) -> tuple:
        key = (slot, rows)
        if key not in self._denoise:
            c, dev = self.model.cfg, self.arena.device
            # [H, A] fp32 like VLA.make_noise: the flow state stays fp32 under bf16
            noise_s = torch.zeros(c.action_horizon, c.action_dim, device=dev)
            plen_s = torch.full((), rows, dtype=torch.int64, device=dev)  # [] prefix length
            expert, arena = self.model.expert, self.arena
            replay, out = self.graph_of(lambda: expert.sample(arena, slot, plen_s, noise_s, rows))
            self._denoise[key] = (replay, out, noise_s, plen_s)
        return self._denoise[key]

    @torch.no_grad()
    def sample_guided(self, slot: int, prefix_len: int, noise: torch.Tensor, guide, rtc):
        """Replay the RTC-guided Euler loop (model/rtc.py) for (slot, row bucket, guidance,
        beta) -> chunk [H, A]; None when off. The VJP runs inside the graph."""
        if not self.enabled:
            return None
        rows = denoise_rows(prefix_len, self.arena.spec.max_len)
        replay, out, noise_s, plen_s, target_s, w_s = self._guided_graph(slot, rows, rtc)
        self._refresh_constants()
        noise_s.copy_(noise, non_blocking=True)
        plen_s.fill_(prefix_len)
        target_s.copy_(guide.target, non_blocking=True)
        w_s.copy_(guide.weights, non_blocking=True)
        replay()
        self.replays += 1
        return out.clone()

    def _guided_graph(self, slot: int, rows: int, rtc) -> tuple:
        key = (slot, rows, rtc.guidance, rtc.max_guidance)
        if key not in self._guided:
            c, dev = self.model.cfg, self.arena.device
            noise_s = torch.zeros(c.action_horizon, c.action_dim, device=dev)
            plen_s = torch.full((), rows, dtype=torch.int64, device=dev)
            target_s = torch.zeros(c.action_horizon, c.action_dim, device=dev)  # [H, A] Y
            w_s = torch.zeros(c.action_horizon, device=dev)  # [H] W
            expert, arena = self.model.expert, self.arena
            beta, kind = rtc.max_guidance, rtc.guidance

            def fn():
                return sample_guided(expert, arena, slot, plen_s, noise_s, target_s, w_s, beta,
                                     kind, rows)  # fmt: skip

            replay, out = self.graph_of(fn)
            self._guided[key] = (replay, out, noise_s, plen_s, target_s, w_s)
        return self._guided[key]

    # -- vision ----------------------------------------------------------------------

    @torch.no_grad()
    def vision(self, images: torch.Tensor) -> torch.Tensor | None:
        """Replay the tower for images [C, 3, S, S] -> image tokens [C, P, W] (a copy), or
        None when graphs are off (the caller runs the tower eagerly)."""
        v = self.model.cfg.vision
        if not self.enabled or tuple(images.shape[1:]) != (3, v.image_size, v.image_size):
            return None  # the eager tower refuses a wrong image shape with its message
        replay, out, images_s = self._vision_graph(images.shape[0])
        images_s.copy_(images, non_blocking=True)
        replay()
        self.replays += 1
        return out.clone()

    def _vision_graph(self, cams: int) -> tuple:
        if cams not in self._vision:
            v = self.model.cfg.vision
            tower = self.model.vision
            dtype = tower.tower.embeddings.patch_embedding.weight.dtype  # the tower's input
            images_s = torch.zeros(cams, 3, v.image_size, v.image_size, dtype=dtype,
                                   device=self.arena.device)  # fmt: skip
            replay, out = self.graph_of(lambda: tower(images_s))
            self._vision[cams] = (replay, out, images_s)
        return self._vision[cams]

    # -- capture ---------------------------------------------------------------------

    @torch.no_grad()
    def graph_of(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """-> (replay, out): replay() recomputes fn over the static buffers into `out`."""
        self.captures += 1
        if self.mode == "emulate":
            return _emulate_capture(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


def _emulate_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Warm up, then record fn's tensor ops over the static buffers (graph_emulation.py):
    host values frozen, host reads of tensors refused, as in a CUDA capture."""
    for _ in range(WARMUP_ITERS):
        fn()
    run, out = record(fn)  # out: the static output buffer

    def replay() -> None:
        out.copy_(run())

    return replay, out
