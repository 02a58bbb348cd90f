"""A frame's prefill logits, computed by the tied LM head only when something reads them.

The prefill of a frame feeds two readers: the action expert (the prefix's K/V rows) and,
sometimes, a language request that starts from the frame (the logits of the prefix's last
token, its first token). At pi05 the head is [R, 2048] x [2048, 257152]: ~1 GB of bf16
weights read, 0.37 ms on an H100, on the action's critical path for no action. So the
step keeps the rows the head reads ([R, W], R = storage/step.py `logit_rows`) and the head
runs on first read, after the chunk (kv/manager.py reads it when a request is created).

Bytes: the same GEMM over the same [R, W] rows as the step's own head
(GemmaBackbone.logits = head(head_rows(...))), so the same logits whenever it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LazyLogits:
    """Logits [V] of row `index` of a step's LM-head rows, computed on first read; indexes
    like the [V] tensor it stands for (`logits[None]`, `logits[:k]`)."""

    def __init__(self, rows: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                 index: int = 0):  # fmt: skip
        self._rows: torch.Tensor | None = rows  # [R, W] (a copy: never a graph's buffer)
        self._head = head
        self._index = index
        self._value: torch.Tensor | None = None

    @property
    def computed(self) -> bool:
        return self._value is not None

    def value(self) -> torch.Tensor:
        """The logits [V] fp32 (the head runs now if it has not yet)."""
        if self._value is None:
            self._value = self._head(self._rows)[self._index]
            self._rows = None  # the [R, W] rows are not needed again
        return self._value

    def __getitem__(self, key) -> torch.Tensor:
        return self.value()[key]
