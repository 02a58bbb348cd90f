"""Which language tasks a frame spawns: the same policy for the unified loop and the
isolated baseline, so both see identical work."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

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

    def __post_init__(self):
        if self.period_s <= 0 or self.narrate_every < 0 or self.max_decode_steps < 0:
            raise ValueError(f"bad loop config: {self}")
        if min(self.narration_tokens, self.answer_tokens) < 1:
            raise ValueError(f"token budgets must be >= 1: {self}")


def arena_rows_needed(model: ModelConfig, loop: LoopConfig) -> int:
    """Rows per slot that one frame's request needs, so nothing is cut short:

        [ cameras x image tokens | prompt <= max_text_tokens ]   the frame's prefix
        [ question / plan text <= max_text_tokens ]               what a request appends
        [ budget - 1 generated tokens ]                           the last one is never fed
        + 2                                                       manager.create's margin

    rounded up to the arena's key block (pi05: 3 x 256 + 200 + 200 + 48 + 1 -> 1280)."""
    rows = (
        model.prefix_tokens_max
        + model.max_text_tokens
        + max(loop.narration_tokens, loop.answer_tokens)
        + 1
    )
    return -(-rows // KEY_BLOCK) * KEY_BLOCK


@dataclass(frozen=True)
class TaskSpec:
    request_id: str
    kind: TaskKind
    suffix: str  # text appended after the frame's prefix ('' for narration)
    max_new_tokens: int
    optional: bool  # may be skipped when no slot is free


class LanguagePolicy:
    """Narration every Nth frame; questions from outside become answer requests of the
    next frame; plan requests carry their own prompt text (the memory)."""

    def __init__(self, cfg: LoopConfig):
        self.cfg = cfg
        self._asked: deque[TaskSpec] = deque()
        self._lock = threading.Lock()

    def ask(self, request_id: str, text: str, kind: TaskKind = TaskKind.ANSWER) -> None:
        if kind is TaskKind.NARRATION:
            raise ValueError("narrations come from the policy, not from ask()")
        suffix = f"\nQuestion: {text}\nAnswer: " if kind is TaskKind.ANSWER else text
        spec = TaskSpec(request_id, kind, suffix, self.cfg.answer_tokens, optional=False)
        with self._lock:
            self._asked.append(spec)

    def tasks_for(self, frame: int) -> list[TaskSpec]:
        """Questions first (someone waits for them), then the optional narration."""
        with self._lock:
            tasks = list(self._asked)
            self._asked.clear()
        n = self.cfg.narrate_every
        if n and frame % n == 0:
            tasks.append(
                TaskSpec(
                    f"narration-{frame}", TaskKind.NARRATION, "", self.cfg.narration_tokens, True
                )
            )
        return tasks
