"""The unified KV cache manager (OxyGen §3.2): one prefill per frame, shared by tasks.

A frame's prefix is prefilled once into a slot. The action expert reads that slot;
the first language request of the frame adopts it (zero copy), further requests of
the same frame get a byte copy (`copy_slot`, no recompute). Live requests are
retrieved as one batch, decoded in one packed step, updated and released.

    frame t:  slot 3 = [prefix(t)]                 <- action expert reads rows [0, P)
    narration of t adopts slot 3: [prefix(t) | tok tok tok ...]
    answer of t gets slot 5 = copy of [prefix(t)] | question | tok tok ...

Running out of slots is policy, never an exception on the hot path: a frame that
finds no slot ends the oldest request early (`truncated`). Requests are admitted
only into a free slot with their whole prompt (`create` returns None otherwise: the
caller defers or skips them), so no request ever decodes over a cut or empty prefix.
Every request ends with a status (`Status`) and, unless `ok`, a reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from embodied_kv.kv.compress import (
    CompressConfig,
    Compressor,
    PrefixLayout,
    Selection,
    StatsRecorder,
    compact,
)
from embodied_kv.model.lazy_logits import LazyLogits
from embodied_kv.model.vla import VLA, Prefix, StepInput
from embodied_kv.storage.arena import KVArena
from embodied_kv.timing import synchronize


class TaskKind(enum.Enum):
    NARRATION = "narration"
    ANSWER = "answer"
    PLAN = "plan"


class Status(enum.Enum):
    """How a request ended (TextChunk.STATUS_*): decoded to EOS or its budget, ended
    early (slot taken by a frame, length), never admitted, or dropped by a restore."""

    OK = "ok"
    TRUNCATED = "truncated"
    REFUSED = "refused"
    CANCELLED = "cancelled"


@dataclass
class FramePrefix:
    frame: int
    slot: int
    prefix_len: int
    logits: torch.Tensor | LazyLogits  # [V] after the prefix's last token (lazy: the head
    # runs on first read, after the action)
    prompt_truncated: bool
    adopted: bool = False  # a request owns the slot now
    # VL-Cache (kv/compress.py): the prefill's statistics until the rows to keep are chosen
    # (KVCacheManager.selection: after the action expert, so no host sync delays it)
    pending: tuple[PrefixLayout, StatsRecorder | None] | None = None
    selection: Selection | None = None  # rows to keep, once chosen
    compressed: bool = False  # the slot holds only the selection now


@dataclass
class Request:
    """Generation state of one language request."""

    request_id: str
    kind: TaskKind
    frame: int
    slot: int | None  # None once freed (finished early, kept only for its text)
    max_new_tokens: int
    pending: list[int]  # ids fed in the next step (a question, or the last token)
    tokens: list[int] = field(default_factory=list)  # generated so far
    emitted: int = 0  # tokens already reported as text
    done: bool = False
    truncated: bool = False  # ended early (slots, length limit), not by EOS or budget
    reason: str = ""  # why it was truncated
    generator: torch.Generator | None = None  # temperature sampling; None = greedy
    temperature: float = 1.0


@dataclass
class ManagerCounters:
    frames: int = 0
    requests: int = 0
    finished: int = 0
    truncated: int = 0
    narrations_skipped: int = 0  # no slot for an optional task
    deferred: int = 0  # frames a waiting question / plan was not admitted in (no free slot)
    refused: int = 0  # tasks whose prompt could not be admitted (reason on their event)
    prompts_truncated: int = 0  # instruction longer than max_text_tokens
    decode_steps: int = 0
    tokens: int = 0


class KVCacheManager:
    def __init__(
        self, model: VLA, num_slots: int, max_len: int, compress: CompressConfig | None = None
    ):
        if num_slots < 2:
            raise ValueError(
                f"num_slots={num_slots}: one frame slot plus one request slot at least"
            )
        self.model = model
        self.arena: KVArena = model.new_arena(num_slots, max_len)
        self.requests: dict[str, Request] = {}  # live, in creation order
        self.counters = ManagerCounters()
        self.eos_id = model.tokenizer.eos_id
        self.compress = compress or CompressConfig()
        self.compressor = Compressor(self.compress, model)

    # -- frames ----------------------------------------------------------------------

    def prefill_frame(self, frame: int, prefix: Prefix) -> FramePrefix:
        """The one prefill of a frame. Frees a slot by truncating the oldest request if
        every slot is taken (the action deadline outranks language)."""
        slot = self.arena.allocate()
        if slot is None:
            oldest = self._oldest_holding_slot()
            if oldest is None:
                raise RuntimeError(
                    f"no free slot for frame {frame}: all {self.arena.spec.num_slots} slots are "
                    "held outside the manager (fork branches?)"
                )
            self.truncate(oldest, f"slot taken by the prefill of frame {frame}")
            slot = self.arena.allocate()
        self.counters.frames += 1
        self.counters.prompts_truncated += int(prefix.prompt_truncated)
        layout = PrefixLayout(prefix.embeds.shape[0], prefix.n_image)
        recorder = self.compressor.recorder(slot, layout)  # VL-Cache statistics, or None
        # the LM head runs only if a request reads the logits (model/lazy_logits.py)
        logits = self.model.prefill(self.arena, slot, prefix, observer=recorder, lazy=True)
        fp = FramePrefix(frame, slot, layout.n_rows, logits, prefix.prompt_truncated)
        if self.compress.enabled and layout.n_image:
            fp.pending = (layout, recorder)
            if self.compress.compress_expert:
                self._compress(fp)  # before the action expert reads it
        return fp

    def selection(self, fp: FramePrefix) -> Selection | None:
        """The rows the frame's language requests keep (None: the full prefix); chosen on
        first use from the prefill's statistics (budgets and top-k read them on the host)."""
        if fp.pending is not None:
            fp.selection = self.compressor.select(*fp.pending)
            fp.pending = None
        return fp.selection

    def _compress(self, fp: FramePrefix) -> None:
        """Compact the frame's slot to its selection (once: later copies copy it so)."""
        if self.selection(fp) is not None and not fp.compressed:
            compact(self.arena, fp.slot, fp.selection)
            fp.compressed = True

    def end_frame(self, fp: FramePrefix) -> None:
        """Give the frame's slot back unless a request adopted it."""
        if not fp.adopted:
            self.arena.release(fp.slot)

    # -- requests --------------------------------------------------------------------

    def create(
        self,
        fp: FramePrefix,
        request_id: str,
        kind: TaskKind,
        max_new_tokens: int,
        suffix_ids: list[int] | None = None,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        prefill=None,
    ) -> Request | None:
        """A request continuing from the frame's prefix, plus `suffix_ids` (a question).

        The first request of a frame adopts the frame's slot; later ones get a free slot
        with a byte copy. None when no slot is free (the caller defers or skips it: a
        request never takes a slot from another one). ValueError when the prompt and
        the token budget do not fit the slot: a prompt is never cut.

        `prefill(slot) -> logits [V]` appends the suffix itself (a KEEP plan over cached
        memory KV) instead of the next decode step; if it raises, the slot is as before."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already live")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        suffix = list(suffix_ids or [])
        need = fp.prefix_len + len(suffix) + max_new_tokens  # rows written stay below it
        if need >= self.arena.spec.max_len:
            raise ValueError(
                f"request {request_id}: prefix {fp.prefix_len} + prompt {len(suffix)} + "
                f"{max_new_tokens} new tokens = {need} rows > slot of {self.arena.spec.max_len}"
            )
        if fp.adopted:
            slot = self.arena.allocate()
            if slot is None:
                return None
            self.arena.copy_slot(fp.slot, slot)
        else:
            slot, fp.adopted = fp.slot, True
            self._compress(fp)  # a language request decodes over the compressed prefix
        req = Request(request_id, kind, fp.frame, slot, max_new_tokens, [])
        req.generator, req.temperature = generator, temperature
        if prefill is not None:
            lengths, pos = self.arena.length[:, slot].clone(), self.arena.next_pos[slot].clone()
            try:
                logits = prefill(slot)
            except BaseException:
                if slot == fp.slot:  # per layer as it was: VL-Cache may have compressed it
                    fp.adopted = False
                    self.arena.length[:, slot], self.arena.next_pos[slot] = lengths, pos
                else:
                    self.arena.release(slot)
                raise
            self._accept(req, self._pick([req], logits[None])[0])
        elif suffix:
            req.pending = suffix
        else:
            self._accept(req, self._pick([req], fp.logits[None])[0])
        self.requests[request_id] = req
        self.counters.requests += 1
        return req

    def live(self) -> list[Request]:
        return [r for r in self.requests.values() if not r.done]

    def batch(self) -> list[StepInput]:
        """Every live request's pending ids as one packed step."""
        return [StepInput(r.slot, ids=torch.tensor(r.pending)) for r in self.live()]

    def decode_step(self) -> list[Request]:
        """Decode one step for all live requests together; returns those that advanced."""
        live = self.live()
        if not live:
            return []
        self.advance(live, self.model.step(self.arena, self.batch()))
        return live

    def advance(self, live: list[Request], logits: torch.Tensor) -> None:
        """Take one token per request from logits [len(live), V] of a step that ran
        `batch()` (here, or inside a larger packed step: ActionFlow's `ar` mode)."""
        for req, token in zip(live, self._pick(live, logits), strict=True):
            self._accept(req, token)
        self.counters.decode_steps += 1

    def _pick(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """Next token of each request from its logits row ([len(reqs), V] on the device).

        Greedy rows: one argmax over the batch on the device. Sampled rows (a request's
        own CPU generator, so a capsule can carry its state): softmax and multinomial on
        the host, as always. One host sync reads everything."""
        greedy = logits.argmax(-1)  # [B] on the device
        sampled = any(r.generator is not None for r in reqs)
        ids, rows = read_host(greedy, logits.float() if sampled else None)
        tokens = ids.tolist()
        for i, req in enumerate(reqs):
            if req.generator is not None:
                probs = torch.softmax(rows[i] / req.temperature, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=req.generator))
        return tokens

    def _accept(self, req: Request, token: int) -> None:
        self.counters.tokens += 1
        if token == self.eos_id:
            self._finish(req)
            return
        req.tokens.append(token)
        req.pending = [token]
        if len(req.tokens) >= req.max_new_tokens:
            self._finish(req)

    def _finish(self, req: Request) -> None:
        req.done = True
        req.pending = []
        self.counters.finished += 1

    def truncate(self, req: Request, reason: str) -> None:
        """End a request early and free its slot now; the record (and its text so far)
        stays until `release`, so the consumer still sees the final event."""
        if not req.done:
            req.truncated, req.reason = True, reason
            self.counters.truncated += 1
            self._finish(req)
        self._free_slot(req)

    def release(self, req: Request) -> None:
        """Forget a finished or abandoned request and free its slot if it holds one."""
        if self.requests.pop(req.request_id, None) is not None:
            self._free_slot(req)

    def _free_slot(self, req: Request) -> None:
        if req.slot is not None:
            self.arena.release(req.slot)
            req.slot = None

    def text(self, req: Request) -> str:
        return self.model.tokenizer.decode(req.tokens)


def read_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Device tensors -> host copies after one synchronization (None passes through)."""
    out = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    devices = {t.device for t in tensors if t is not None}
    for device in devices:
        synchronize(device)
    return out
