"""A fused op whose Triton kernel cannot be built on this machine runs its torch reference.

Triton compiles a kernel at its first launch, for the GPU and the Triton at hand: a tile
that needs more shared memory than a smaller GPU has (`OutOfResources`), a construct
another Triton release does not take (`CompilationError`), a ptxas failure. Each is raised
at that launch, before anything runs on the device, so the op can still be computed: the
op's kernel is switched off for the process (`OFF`, with the reason, logged once) and its
reference runs, now and at every later call. The robot keeps acting, slower in that op;
`Engine.diagnostics()` and `bench latency` report what is off. Only Triton's own errors are
taken this way (their class is defined in a `triton` module); a mistake of ours still raises.

Every dispatcher (`rope`, `expert_attention`, ...) runs its kernel through `try_kernel`
and its reference when that gives None; where no kernel applies (a CPU) nothing here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)
OFF: dict[str, str] = {}  # op -> why its kernel is off in this process


def from_triton(e: BaseException) -> bool:
    """The error is Triton's (compile, resources, ptxas), by where its class is defined."""
    return any(c.__module__.split(".")[0] == "triton" for c in type(e).__mro__)


def try_kernel(op: str, kernel: Callable, *args, **kwargs):
    """`kernel(*args, **kwargs)`, or None when the op's kernel is off, or raises a Triton
    error (the op is then off: the caller runs its reference). A kernel returns tensors."""
    if op in OFF:
        return None
    try:
        return kernel(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Triton's failures only, re-raised otherwise
        if not from_triton(e):
            raise
        OFF[op] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        log.warning("the %s kernel cannot run here (%s): its torch reference runs instead",
                    op, OFF[op])  # fmt: skip
        return None
