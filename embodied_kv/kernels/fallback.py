"""A fused op whose Triton kernel cannot be built on this machine runs its torch reference.

Triton compiles a kernel at its first launch, for the GPU and the Triton at hand: a tile
that needs more shared memory than a smaller GPU has (`OutOfResources`), a construct
another Triton release does not take (`CompilationError`), a ptxas failure. Each is raised
at that launch, before anything runs on the device, so the op can still be computed: the
op's kernel is switched off for the process (`OFF`, with the reason, logged once) and its
reference runs, now and at every later call. The robot keeps acting, slower in that op;
`Engine.diagnostics()` and `bench latency` report what is off. Only Triton's own errors are
taken this way (their class is defined in a `triton` module); a mistake of ours still raises.

Every dispatcher (`rope`, `expert_attention`, ...) goes through `dispatch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
OFF: dict[str, str] = {}  # op -> why its kernel is off in this process


def from_triton(e: BaseException) -> bool:
    """The error is Triton's (compile, resources, ptxas), by where its class is defined."""
    return any(c.__module__.split(".")[0] == "triton" for c in type(e).__mro__)


def dispatch(op: str, on: bool, kernel: Callable[[], T], ref: Callable[[], T]) -> T:
    """`kernel()` when `on` (the op's dispatch rule, `use_kernel`) and the op's kernel is not
    off; `ref()` otherwise, and when the kernel raises a Triton error (the op is then off)."""
    if on and op not in OFF:
        try:
            return kernel()
        except Exception as e:  # noqa: BLE001 - Triton's failures only, re-raised otherwise
            if not from_triton(e):
                raise
            OFF[op] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            log.warning("the %s kernel cannot run here (%s): its torch reference runs instead",
                        op, OFF[op])  # fmt: skip
    return ref()
