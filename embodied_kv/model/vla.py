"""The Mixture-of-Transformers VLA over the arena (pi0.5 class).

Every backbone call is one packed step (`VLA.step`); prefill, append, decode and
mixed batches are that step with different inputs. The action expert reads a
prefix slot and never writes the arena.

    prefix of a frame:  [cam0 tokens | cam1 tokens | ... | BOS Task: ..., State: ...;\\nAction: ]
                        bidirectional within itself; positions 0..P-1
    language request:   continues causally in the same slot from position P
    action expert:      H action tokens at positions P..P+H-1, read rows [0, P)

The action expert always reads a bucket of rows, `denoise_rows(P, max_len)`, and masks
those >= P, so the eager path and the denoise graph (engine/graphs.py) run the same
shapes and give the same bytes whether or not a graph exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from embodied_kv.kernels.triton_base import as_dtype
from embodied_kv.model.backbone import GemmaBackbone
from embodied_kv.model.camera_frames import CameraFrames
from embodied_kv.model.config import ModelConfig
from embodied_kv.model.expert import ActionExpert
from embodied_kv.model.lazy_logits import LazyLogits
from embodied_kv.model.prompt import make_tokenizer, tokenize_prompt
from embodied_kv.model.rtc import Guide, RTCConfig, sample_guided
from embodied_kv.model.vision import VisionEncoder
from embodied_kv.storage.arena import ArenaSpec, KVArena
from embodied_kv.storage.step import Segment, commit_step, plan_step, to_device

MAX_POSITIONS = 32_768  # RoPE table rows (fp32, full width: 2 x 32 MiB at pi05); bounds max_len
# prefix rows the action expert reads: every 64 up to 1024, where pi05 prefixes fall (2
# cameras + text ~560-663, 3 ~820-921; 64 = the expert attention's 4 key blocks of 16, one
# split's chunk), then 2048. With (256, 512, 1024) a 663-row prefix read 1,024 rows (32
# splits, 13 MB of fp32 partials a call); now 704 (16 splits). At most 16 denoise graphs
# per slot up to 1024 rows (engine/graphs.py captures those a fresh prefix can need).
DENOISE_ROW_STEP = 64
DENOISE_BUCKETS = (*range(DENOISE_ROW_STEP, 1025, DENOISE_ROW_STEP), 2048)


def denoise_rows(prefix_len: int, max_len: int) -> int:
    """Rows the action expert reads for a prefix of `prefix_len`: the smallest bucket
    that holds it within the slot, else the whole slot (max_len)."""
    return next((b for b in DENOISE_BUCKETS if prefix_len <= b <= max_len), max_len)


@dataclass
class Observation:
    # [num_cameras, 3, S, S] in [-1, 1], rows of absent cameras ignored; or the cameras'
    # uint8 frames, converted on the model's device inside embed_prefix (camera_frames.py)
    images: torch.Tensor | CameraFrames
    state: np.ndarray  # [<= state_dim] state normalised to about [-1, 1] (in the prompt)
    instruction: str
    camera_mask: tuple[bool, ...] | None = None  # None: all cameras present
    robot_state: np.ndarray | None = None  # [S] the same state in robot units (delta actions)
    # False: the state was captured before the instruction arrived (it shows the scene as it
    # was before the task was given): its chunk acts, but real-time chunking does not hold
    # the next chunk to it (engine/frame_loop.py)
    after_instruction: bool = True


@dataclass(frozen=True)
class StepInput:
    """New tokens of one slot for a packed step: ids or ready embeddings."""

    slot: int
    ids: torch.Tensor | None = None  # [n] token ids
    embeds: torch.Tensor | None = None  # [n, W] (image + text prefix)
    causal: bool = True

    @property
    def n(self) -> int:
        return int(self.ids.shape[0] if self.ids is not None else self.embeds.shape[0])


@dataclass(frozen=True)
class Prefix:
    embeds: torch.Tensor  # [P, W]
    prompt_truncated: bool
    n_image: int = 0  # image rows at the front; rows [n_image, P) are the prompt text


class VLA(nn.Module):
    def __init__(self, cfg: ModelConfig, tokenizer_path: str | None = None):
        super().__init__()
        self.cfg = cfg
        self.max_pos = max_pos = MAX_POSITIONS
        self.vision = VisionEncoder(cfg.vision, cfg.backbone.width)
        self.backbone = GemmaBackbone(cfg.backbone, cfg.vocab_size, max_pos)
        self.expert = ActionExpert(cfg, max_pos)
        self.tokenizer = make_tokenizer(cfg.tokenizer, tokenizer_path)
        self.graphs = None  # engine.graphs.GraphRunner over one arena (set by the engine)
        self.weights_id: str | None = None  # model.weights: what the weights are; None = hash them
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} ids > vocab {cfg.vocab_size}"
            )

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed_tokens.weight.dtype

    def arena_spec(self, num_slots: int, max_len: int) -> ArenaSpec:
        b = self.cfg.backbone
        return ArenaSpec(b.layers, num_slots, max_len, b.kv_heads, b.head_dim, self.dtype)

    def new_arena(self, num_slots: int, max_len: int) -> KVArena:
        if max_len + self.cfg.action_horizon > self.max_pos:
            raise ValueError(f"max_len={max_len} + action horizon exceeds {self.max_pos} positions")
        return KVArena(self.arena_spec(num_slots, max_len), self.device)

    # -- inputs -------------------------------------------------------------------------

    @torch.no_grad()
    def embed_prefix(self, obs: Observation) -> Prefix:
        """Image tokens of the present cameras, then the embedded pi0.5 prompt -> [P, W]."""
        c = self.cfg
        mask = obs.camera_mask or (True,) * c.num_cameras
        if len(mask) != c.num_cameras or obs.images.shape[0] != c.num_cameras:
            raise ValueError(
                f"expected {c.num_cameras} camera images and mask entries, got "
                f"{obs.images.shape[0]} and {len(mask)}"
            )
        if isinstance(obs.images, CameraFrames) and obs.images.size != c.vision.image_size:
            raise ValueError(f"camera frames for {obs.images.size} pixels, the model's "
                             f"are {c.vision.image_size}")  # fmt: skip
        prompt = self.prompt_tokens(obs)
        ids = to_device(torch.tensor(prompt.ids, dtype=torch.long), self.device)
        parts = []
        present = [i for i, m in enumerate(mask) if m]
        if present:
            if isinstance(obs.images, CameraFrames):  # converted here: camera -> chunk
                imgs = obs.images.to_input(present, self.device)
            else:
                imgs = to_device(obs.images[present], self.device)  # the tower casts (fp32)
            tokens = self.graphs.vision(imgs) if self.graphs is not None else None
            tokens = self.vision(imgs) if tokens is None else tokens  # graphs off: eager
            parts.append(tokens.reshape(-1, c.backbone.width).to(self.dtype))
        parts.append(self.backbone.embed(ids))
        n_image = parts[0].shape[0] if present else 0
        return Prefix(torch.cat(parts, dim=0), prompt.truncated, n_image)

    def prompt_tokens(self, obs: Observation):
        """The pi0.5 prompt of `obs` (task and discretised state) as token ids."""
        # Only the robot's own dims go into the prompt, unpadded: openpi TokenizePrompt runs
        # before PadStatesAndActions; LeRobot Pi05PrepareStateTokenizerProcessorStep.
        c = self.cfg
        state = np.asarray(obs.state).reshape(-1)
        if state.shape[0] > c.state_dim:
            raise ValueError(f"state of {state.shape[0]} dims > the model's {c.state_dim}")
        return tokenize_prompt(
            self.tokenizer, obs.instruction, state, c.max_text_tokens, c.state_bins
        )

    def make_noise(self, seed: int) -> torch.Tensor:
        """Seeded fp32 noise [H, A] (the flow state stays fp32 under bf16), drawn on the
        CPU so every device gets the same values."""
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(self.cfg.action_horizon, self.cfg.action_dim, generator=g)
        return to_device(h, self.device)

    # -- the one packed step --------------------------------------------------------------

    @torch.no_grad()
    def step(
        self, arena: KVArena, inputs: list[StepInput], pad_to: int = 0, observer=None
    ) -> torch.Tensor:
        """Run one packed step; returns fp32 logits [len(inputs), V] at each input's last
        token, on the model's device (no host sync).

        Replays a graph when engine/graphs.py holds one for this arena and size; else
        runs eagerly, padded to `pad_to` tokens if given (a graph's shapes). An `observer`
        (GemmaBackbone.forward) always runs eagerly: a graph has no place to call it."""
        if self.graphs is not None and self.graphs.arena is arena and observer is None:
            logits = self.graphs.step(inputs)  # the head reads the graph's rows in place
            if logits is not None:
                return logits
        rows = self._eager_rows(arena, inputs, pad_to, observer)
        return self.backbone.head(rows)[: len(inputs)]

    @torch.no_grad()
    def step_rows(
        self, arena: KVArena, inputs: list[StepInput], pad_to: int = 0, observer=None
    ) -> torch.Tensor:
        """`step` without its LM head: the rows the head reads, [logit_rows, W] (row i is
        input i's last token; `backbone.head` of them is `step`'s logits, same bytes)."""
        if self.graphs is not None and self.graphs.arena is arena and observer is None:
            rows = self.graphs.step_rows(inputs)
            if rows is not None:
                return rows
        return self._eager_rows(arena, inputs, pad_to, observer)

    def _eager_rows(self, arena, inputs, pad_to, observer) -> torch.Tensor:
        segments = [Segment(i.slot, i.n, i.causal) for i in inputs]
        plan = plan_step(arena, segments, pad_to)
        hidden = self.backbone(self.embed_inputs(inputs, plan.n_padded), plan, arena, observer)
        commit_step(arena, plan)
        return self.backbone.head_rows(hidden, plan.last_index)

    def embed_inputs(self, inputs: list[StepInput], n_padded: int) -> torch.Tensor:
        """The step's token embeddings laid out flat, zero rows as padding -> [n_padded, W].

        Every input's ids are embedded in one lookup after one non-blocking copy."""
        dev, dtype = self.device, self.dtype
        x = torch.zeros(n_padded, self.cfg.backbone.width, device=dev, dtype=dtype)
        ids = [i.ids.reshape(-1) for i in inputs if i.embeds is None]
        if ids:
            if all(t.device != dev for t in ids):  # host ids: one copy for all
                flat = to_device(torch.cat(ids), dev)  # [sum n]
            else:
                flat = torch.cat([to_device(t, dev) for t in ids])
            embedded = as_dtype(self.backbone.embed(flat), dtype)  # [sum n, W]
            if len(ids) == len(inputs):  # ids only (a decode): laid out as they come
                x[: embedded.shape[0]] = embedded
                return x
        start, used = 0, 0
        for inp in inputs:
            if inp.embeds is None:
                x[start : start + inp.n] = embedded[used : used + inp.n]
                used += inp.n
            else:
                x[start : start + inp.n] = inp.embeds.to(dtype)
            start += inp.n
        return x

    def prefill(
        self, arena: KVArena, slot: int, prefix: Prefix, observer=None, lazy: bool = False
    ) -> torch.Tensor | LazyLogits:
        """Bidirectional prefix into an empty slot -> logits [V] of its last token. The
        prefix's tokens are rows [0, P) of the step (an `observer` sees them so).

        `lazy`: the LM head runs when the logits are first read (model/lazy_logits.py): a
        frame's prefill, whose logits only a language request reads, after the action."""
        if arena.slot_len(slot):
            raise ValueError(
                f"prefill needs an empty slot; slot {slot} holds {arena.slot_len(slot)} rows"
            )
        inputs = [StepInput(slot, embeds=prefix.embeds, causal=False)]
        if lazy:
            return LazyLogits(self.step_rows(arena, inputs, observer=observer), self.backbone.head)
        return self.step(arena, inputs, observer=observer)[0]

    def append(self, arena: KVArena, slot: int, ids: torch.Tensor) -> torch.Tensor:
        """Causal text appended to a slot -> logits [V] after its last token."""
        return self.step(arena, [StepInput(slot, ids=ids)])[0]

    def decode(self, arena: KVArena, slots: list[int], ids: torch.Tensor) -> torch.Tensor:
        """One token for each slot in one step: ids [B] -> logits [B, V]."""
        rows = ids.view(-1, 1).unbind()  # B views [1], made in one call
        return self.step(arena, [StepInput(s, ids=r) for s, r in zip(slots, rows, strict=True)])

    @torch.no_grad()
    def sample_actions(
        self,
        arena: KVArena,
        slot: int,
        prefix_len: int,
        noise: torch.Tensor,
        compressed: bool = False,
        guide: Guide | None = None,
        rtc: RTCConfig | None = None,
    ) -> torch.Tensor:
        """Action chunk [H, A] from the prefix rows [0, prefix_len) of `slot`.

        `guide` (with `rtc`): real-time chunking towards the previous chunk (model/rtc.py);
        None: the plain Euler loop.

        Replays the denoise graph when engine/graphs.py holds one for this arena; the
        eager path computes the same bytes (same row bucket, same masked loop).
        `compressed`: the slot's prefix was compacted by VL-Cache (kv/compress.py), layer l
        keeps rows [0, length[l]) of it; the suffix's positions still follow prefix_len
        (RoPE of the kept keys is untouched). Eager only."""
        if guide is not None and rtc is None:
            raise ValueError("a guided chunk needs its RTCConfig (max_guidance, guidance)")
        lens = arena.length[:, slot]
        if compressed:
            if not (0 < int(lens.min()) and int(lens.max()) <= prefix_len <= arena.next_pos[slot]):
                raise ValueError(
                    f"compressed slot {slot}: lengths {lens.tolist()} vs prefix_len {prefix_len}"
                )
            rows = denoise_rows(int(lens.max()), arena.spec.max_len)
            plen = torch.full((), prefix_len, dtype=torch.int64, device=self.device)
            layer_rows = to_device(lens.clone(), self.device)
            if guide is not None:
                return sample_guided(self.expert, arena, slot, plen, noise, guide.target,
                                     guide.weights, rtc.max_guidance, rtc.guidance, rows,
                                     layer_rows)  # fmt: skip
            return self.expert.sample(arena, slot, plen, noise, rows, layer_rows)
        if not 0 < prefix_len <= int(lens.min()):
            raise ValueError(
                f"prefix_len {prefix_len} not within slot {slot}'s {arena.slot_len(slot)} rows"
            )
        if self.graphs is not None and self.graphs.arena is arena:
            if guide is None:
                chunk = self.graphs.sample_actions(slot, prefix_len, noise)
            else:
                chunk = self.graphs.sample_guided(slot, prefix_len, noise, guide, rtc)
            if chunk is not None:
                return chunk
        rows = denoise_rows(prefix_len, arena.spec.max_len)
        plen = torch.full((), prefix_len, dtype=torch.int64, device=self.device)  # no H2D copy
        if guide is not None:
            return sample_guided(self.expert, arena, slot, plen, noise, guide.target,
                                 guide.weights, rtc.max_guidance, rtc.guidance, rows)  # fmt: skip
        return self.expert.sample(arena, slot, plen, noise, rows)


def build_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    tokenizer_path: str | None = None,
) -> VLA:
    """A VLA with deterministic random weights (seed cfg.seed), fp32 on CPU, bf16 on CUDA.

    Built on the meta device, given the precision policy's dtypes there
    (model/precision.py), then allocated once on `device`: no parameter exists in
    another dtype or on another device first (at pi05 bf16 that is 6.7 GB, not 20)."""
    from embodied_kv.model.fused import fuse_projections
    from embodied_kv.model.precision import apply_precision
    from embodied_kv.model.weights import init_weights, random_weights_id

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device("meta"):
        model = VLA(cfg, tokenizer_path)
    apply_precision(model, dtype)
    model = model.to_empty(device=device)
    init_weights(model, cfg.seed)
    model.eval()
    for rope in (model.backbone.rope, model.expert.rope):
        rope.reset_tables()
    model.vision.reset_buffers()
    model.weights_id = random_weights_id(cfg, dtype, device)
    if device.type == "cuda":  # q/k/v and gate/up as one GEMM each (model/fused.py)
        fuse_projections(model)
    return model
