"""A persistent kernel's work queue: several phases of work in one launch, with no grid-wide
barrier and no assumption that the programs run at the same time.

The kernel's work is a list of items in dependency order (every item depends only on items
before it). Each program takes the next item with one atomic add on a queue counter, does
it, and takes another until the list is exhausted. An item that needs earlier items waits
for their arrival counter (`wait_for`): an acquire poll, bounded. That cannot deadlock,
whatever the grid and however many programs the GPU runs at once: a program waits only while
it holds an item, so it is running, and what it waits for was taken earlier by programs that
are running too; the earliest unfinished item never waits. Run one program after another
(the interpreter), program 0 takes every item in order and every wait is already met: the
same arithmetic, checked on the CPU.

The poll is bounded (`max_spins`) so that a bug can never hang a GPU: past the bound the
program sets the error flag and goes on (its result is then wrong); `failed` reads the flag.

Reuse without a memset (CUDA graph replay): the program whose failed grab is the last of the
launch (its value is items + programs - 1, so every program has finished) puts the queue
counter back to 0; the arrival counters are reset by the items that consume them.

Hand-off as kernels/gemm_residual.py's split-K: an item's stores, a CTA barrier, then one
atomic (acq_rel, gpu scope) releases them; the waiting item's acquire poll and the barrier that
hands its result to every thread order its loads after them, which read from L2 (.cg).
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.triton_base import tl, triton

# polls (~0.5-1 us each on a GPU) before a wait gives up and flags an error: ~30-60 ms,
# thousands of times the longest wait the expert attention has (its partials take ~15 us),
# and short enough that a bug costs a slow call, not a hung device
MAX_SPINS = 1 << 16
CPU_PROGRAMS = 4  # the grid off CUDA (the interpreter runs programs one after another)
QUEUE_WORDS = 2  # int32: [next item, error flag]


def programs(items: int, device: torch.device | str, per_sm: int = 1) -> int:
    """The persistent grid: `per_sm` programs per SM of the GPU (at most one per item). Any
    grid is correct (see above); more than one a SM only helps where that many fit at once
    (registers, shared memory) and keep more loads in flight than one does."""
    device = torch.device(device)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = CPU_PROGRAMS
    return max(1, min(items, sms * per_sm))


def failed(queue: torch.Tensor) -> bool:
    """True when a wait of a launch on this queue state ran past its bound (reads the device:
    a sync; tests and benches call it, not the action path)."""
    return bool(queue[1].item())


if triton is not None:

    @triton.jit
    def grab(queue_ptr):
        """The next item's index (items past the list mean: nothing left)."""
        return tl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")

    @triton.jit
    def arrive(count_ptr):
        """This program's stores of an item released, then its arrival counted; -> the count
        before it."""
        tl.debug_barrier()
        return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")

    @triton.jit
    def wait_for(count_ptr, target, err_ptr, max_spins):
        """Poll until *count_ptr >= target (acquire); after max_spins polls, set *err_ptr."""
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < max_spins):
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < target:
            tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")

    @triton.jit
    def finish(queue_ptr, last_grab, n_items, counts_ptr, n_counts):
        """After a program's failed grab: the launch's last one (every item is done) puts
        the n_counts arrival counters at counts_ptr and the queue back to 0."""
        if last_grab == n_items + tl.num_programs(0) - 1:
            for i in range(n_counts):
                tl.atomic_xchg(counts_ptr + i, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(queue_ptr, 0, sem="relaxed", scope="gpu")
