"""Which language tasks a frame spawns: the same policy for the unified loop and the
isolated baseline, so both see identical work.

The policy also owns admission: questions and plan requests wait in a bounded queue
(a full queue refuses at once, with the reason), a frame admits as many as it has
free slots for and defers the rest to a later frame, in arrival order. Request ids
are `<kind>-<n>@<epoch>`: `n` counts per kind and is session state (a capsule carries
it), `epoch` names the timeline (EpochTag: a process nonce and the number of
restores in this process), so no two requests of any two timelines, restores or
processes share an id.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import deque
from dataclasses import asdict, dataclass

import torch

from embodied_kv.kernels.packed_attention import KEY_BLOCK
from embodied_kv.kv.manager import TaskKind
from embodied_kv.model.config import ModelConfig


@dataclass(frozen=True)
class LoopConfig:
    period_s: float = 0.1  # control cycle = replan_every / control rate (s)
    narrate_every: int = 0  # every Nth frame narrates (0: never)
    narration_tokens: int = 32  # token budget of a narration
    answer_tokens: int = 64  # token budget of an answer / plan
    max_decode_steps: int = 0  # per cycle, 0 = as many as fit before the deadline
    decode_margin_s: float = 0.002  # slack kept before the deadline (s)
    cost_ema: float = 0.3  # weight of the newest decode-step time in the estimate
    seed: int = 0  # action noise of frame t is drawn with seed + t
    max_pending: int = 16  # questions + plan requests waiting for a slot; more are refused
    request_tokens: int = 0  # longest question / plan prompt a request appends; 0 = the preset's

    def __post_init__(self):
        if self.period_s <= 0 or self.narrate_every < 0 or self.max_decode_steps < 0:
            raise ValueError(f"bad loop config: {self}")
        if min(self.narration_tokens, self.answer_tokens) < 1:
            raise ValueError(f"token budgets must be >= 1: {self}")
        if self.request_tokens < 0:
            raise ValueError(f"request_tokens={self.request_tokens} must be >= 0 (0: the preset's)")
        if self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending} must be >= 1")


def arena_rows_needed(model: ModelConfig, loop: LoopConfig) -> int:
    """Rows per slot that one frame's request needs, so nothing is cut short:

        [ cameras x image tokens | prompt <= max_text_tokens ]   the frame's prefix
        [ question / plan text <= request_tokens ]                what a request appends
        [ budget - 1 generated tokens ]                           the last one is never fed
        + 2                                                       manager.create's margin

    rounded up to the arena's key block (pi05: 3 x 256 + 200 + 200 + 48 + 1 -> 1280).
    request_tokens 0 means the preset's max_text_tokens; a plan prompt carries the memory
    as text, so a robot with memory sets it higher (config/robot.yaml)."""
    rows = (
        model.prefix_tokens_max
        + request_text_tokens(model, loop)
        + max(loop.narration_tokens, loop.answer_tokens)
        + 1
    )
    return -(-rows // KEY_BLOCK) * KEY_BLOCK


def arena_rows(max_len: int, model: ModelConfig, loop: LoopConfig) -> int:
    """max_len, or what the preset and the language budgets need when it is 0;
    ValueError with the number needed when an explicit max_len is too small."""
    needed = arena_rows_needed(model, loop)
    if max_len == 0:
        return needed
    if max_len < needed:
        raise ValueError(
            f"max_len={max_len} is too small for preset {model.name!r}: a frame needs "
            f"{needed} rows per slot ({model.num_cameras} cameras x {model.vision.tokens} "
            f"image tokens + {model.max_text_tokens} prompt + {request_text_tokens(model, loop)} "
            f"question or plan "
            f"+ {max(loop.narration_tokens, loop.answer_tokens)} decoded, rounded up); "
            f"set max_len to {needed} or more, or 0 (auto)"
        )
    return max_len


def request_text_tokens(model: ModelConfig, loop: LoopConfig) -> int:
    """The longest text a request appends after the frame's prefix (tokens)."""
    return loop.request_tokens or model.max_text_tokens


@dataclass(frozen=True)
class TaskSpec:
    request_id: str
    kind: TaskKind
    suffix: str  # text appended after the frame's prefix ('' for narration)
    max_new_tokens: int
    optional: bool  # may be skipped when no slot is free


class QueueFull(ValueError):
    """ask() refused a request: the pending queue is at max_pending."""


PROCESS_NONCE = secrets.token_hex(3)  # tells this process's ids from every other's
_TIMELINES = itertools.count(1)  # every new timeline of every engine of this process


class EpochTag:
    """The timeline part of request ids: `<process nonce>.<timeline>`. Not session
    state: a restore (or an engine built again in this process) moves to a timeline
    never used before. (Ids a capsule holds have counters below the ones it restores,
    so they never repeat either.) Two policies that never advance share `.0`: the
    benchmark's unified and isolated runners name the same requests alike."""

    def __init__(self) -> None:
        self.nonce = PROCESS_NONCE
        self.count = 0

    def __str__(self) -> str:
        return f"{self.nonce}.{self.count}"

    def advance(self) -> None:
        self.count = next(_TIMELINES)


class LanguagePolicy:
    """Narration every Nth frame; questions from outside become answer requests of a
    later frame; plan requests carry their own prompt text (the memory)."""

    def __init__(self, cfg: LoopConfig):
        self.cfg = cfg
        self.epoch = EpochTag()
        self._asked: deque[TaskSpec] = deque()
        self._next = {TaskKind.ANSWER: 1, TaskKind.PLAN: 1}  # session state: per-kind counters
        self._lock = threading.Lock()

    def ask(self, text: str, kind: TaskKind = TaskKind.ANSWER) -> str:
        """Queue a question (ANSWER) or a plan prompt (PLAN) -> its request id.
        QueueFull (nothing queued) when max_pending requests already wait."""
        request_id = self.next_id(kind)
        self.enqueue(request_id, text, kind)
        return request_id

    def next_id(self, kind: TaskKind) -> str:
        if kind is TaskKind.NARRATION:
            raise ValueError("narrations come from the policy, not from ask()")
        with self._lock:
            n = self._next[kind]
            self._next[kind] = n + 1
        return f"{kind.value}-{n}@{self.epoch}"

    def enqueue(self, request_id: str, text: str, kind: TaskKind) -> None:
        suffix = answer_suffix(text) if kind is TaskKind.ANSWER else text
        with self._lock:
            if len(self._asked) >= self.cfg.max_pending:
                raise QueueFull(
                    f"{len(self._asked)} requests already wait for a slot (max_pending="
                    f"{self.cfg.max_pending})"
                )
            self._asked.append(
                TaskSpec(request_id, kind, suffix, self.cfg.answer_tokens, optional=False)
            )

    def tasks_for(self, frame: int, capacity: int | None = None) -> list[TaskSpec]:
        """Up to `capacity` tasks for this frame (None: all): waiting requests first, in
        arrival order (someone waits for them), then the optional narration. Requests
        beyond the capacity stay queued for a later frame."""
        with self._lock:
            n = len(self._asked) if capacity is None else min(capacity, len(self._asked))
            tasks = [self._asked.popleft() for _ in range(n)]
        every = self.cfg.narrate_every
        if every and frame % every == 0:
            tasks.append(
                TaskSpec(
                    f"narration-{frame}@{self.epoch}",
                    TaskKind.NARRATION,
                    "",
                    self.cfg.narration_tokens,
                    True,
                )
            )
        return tasks

    def defer(self, tasks: list[TaskSpec]) -> None:
        """Put required tasks back at the head of the queue, in their order."""
        with self._lock:
            self._asked.extendleft(reversed([t for t in tasks if not t.optional]))

    def pending(self) -> list[TaskSpec]:
        with self._lock:
            return list(self._asked)

    def discard(self, ids: set[str]) -> None:
        """Drop waiting requests by id (ended ones a restore brought back)."""
        with self._lock:
            self._asked = deque(t for t in self._asked if t.request_id not in ids)

    def take_pending(self) -> list[TaskSpec]:
        with self._lock:
            tasks = list(self._asked)
            self._asked.clear()
            return tasks

    # -- capsule section (kv.capsule.Stateful): the queue and the id counters ----------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict:
        with self._lock:
            return {
                "pending": [{**asdict(t), "kind": t.kind.value} for t in self._asked],
                "next": {k.value: n for k, n in self._next.items()},
            }

    def check_state(self, tensors: dict, meta: dict) -> None:
        self._parse(meta)

    def load_state(self, tensors: dict, meta: dict) -> None:
        pending, counters = self._parse(meta)
        with self._lock:
            self._asked = deque(pending)
            self._next = counters

    @staticmethod
    def _parse(meta: dict) -> tuple[list[TaskSpec], dict[TaskKind, int]]:
        try:
            pending = [TaskSpec(**{**d, "kind": TaskKind(d["kind"])}) for d in meta["pending"]]
            counters = {TaskKind(k): int(n) for k, n in meta["next"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"policy section: {type(e).__name__}: {e}") from e
        if set(counters) != {TaskKind.ANSWER, TaskKind.PLAN}:
            raise ValueError(f"policy section: id counters {sorted(k.value for k in counters)}")
        return pending, counters


def answer_suffix(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer: "
