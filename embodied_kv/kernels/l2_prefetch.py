"""Weights into the GPU's L2 cache ahead of the kernels that read them (issue 33 item 1:
"weights prefetched").

At batch 50 the action expert's GEMMs read 34.6 MB of weights a layer-step and do little
with each byte: they are bound by how long a load takes, not by the bandwidth (the H200
profiles: 4-6 us a small GEMM whatever its size; the fused ones stream at 0.3-0.6 TB/s of
4.8). Weights do not depend on the activations, so they can be on their way while the
kernels before them run. This kernel issues prefetches, a hint with no result: the SM does
not wait for the data, the memory system fills L2 while the launch that follows runs, and
the GEMM then reads L2 instead of HBM. model/weight_prefetch.py decides what and when (a
launch on a side stream, so it costs the action path nothing).

One launch covers up to MAX_RANGES byte ranges (a layer's weights are separate tensors),
cut into chunks; each program takes chunks strided over the grid:

    MODE_BULK  one `cp.async.bulk.prefetch.L2` per 16 KiB chunk (sm_90: the copy engine
               walks the chunk; 1.3 k instructions for 21 MB)
    MODE_LINE  one `prefetch.global.L2` per 128-byte line (sm_80 / sm_89)
    MODE_RECORD  the chunks' (address, bytes) written to a buffer: the addressing run under
               TRITON_INTERPRET=1, where inline assembly cannot run (the tests)

Ranges start on a 128-byte line and end on one: the caching allocator's blocks are
512-byte aligned and sized, so a rounded range stays inside its tensor's block.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import Launch, tl, triton, use_kernel

LINE = 128  # bytes: an L2 line (the unit ranges are rounded to)
BULK_CHUNK = 16 * 1024  # bytes a bulk prefetch covers (a multiple of 16)
MAX_RANGES = 4
BLOCK = 128  # chunks a program issues per iteration (4 warps: one a thread)
MAX_PROGRAMS = 32  # enough issuers to keep HBM busy; small beside the kernels it overlaps
MODE_RECORD, MODE_LINE, MODE_BULK = 0, 1, 2


def line_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, bytes) of each tensor's storage span, rounded out to whole lines; empty
    tensors dropped. A tensor is read from data_ptr over numel x element_size (views of a
    contiguous span: the weights here are)."""
    out = []
    for t in tensors:
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        start = t.data_ptr() // LINE * LINE
        end = -(-(t.data_ptr() + n) // LINE) * LINE
        out.append((start, end - start))
    return out


def mode_for(device: torch.device) -> int:
    """The prefetch instruction this GPU has: bulk from sm_90, per line before."""
    major, _ = torch.cuda.get_device_capability(device)
    return MODE_BULK if major >= 9 else MODE_LINE


def kernel_mode(device: torch.device | str, on: bool = True) -> int:
    """The mode a persistent kernel prefetches its phases' weights in (prefetch_share): the
    GPU's; 0 (none) off CUDA, where the interpreter cannot run inline assembly; MODE_BULK
    for `meta` tensors (kernels/offline_compile.py builds for sm_90)."""
    device = torch.device(device)
    if not on or device.type not in ("cuda", "meta") or torch.version.hip:
        return 0  # (ROCm's "cuda" devices take no PTX)
    return MODE_BULK if device.type == "meta" else mode_for(device)


def chunk_bytes(mode: int) -> int:
    return BULK_CHUNK if mode == MODE_BULK else LINE


if triton is not None:

    @triton.jit
    def _l2_prefetch_fwd(
        a0, n0, a1, n1, a2, n2, a3, n3,  # (start, chunks) of up to four ranges
        e0, e1, e2, e3,  # each range's end (bytes: its last chunk may be short)
        out_ptr,  # MODE_RECORD: int64 [chunks, 2] (address, bytes)
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        c1 = n0 + n1
        c2 = c1 + n2
        total = c2 + n3
        for first in range(pid * BLOCK, total, tl.num_programs(0) * BLOCK):
            j = first + tl.arange(0, BLOCK)
            live = j < total
            j64 = j.to(tl.int64)
            # the range of chunk j: its start, its end, j's index inside it
            start = tl.where(j < n0, a0, tl.where(j < c1, a1, tl.where(j < c2, a2, a3)))
            end = tl.where(j < n0, e0, tl.where(j < c1, e1, tl.where(j < c2, e2, e3)))
            base = tl.where(j < n0, 0, tl.where(j < c1, n0, tl.where(j < c2, c1, c2)))
            addr = start + (j64 - base) * CHUNK
            size = tl.minimum(end - addr, CHUNK)
            # dead lanes repeat the first chunk: a prefetch of a valid line, never a fault
            addr = tl.where(live, addr, a0)
            size = tl.where(live, size, tl.minimum(e0 - a0, CHUNK)).to(tl.int32)
            if MODE == 0:
                tl.store(out_ptr + 2 * j64, addr, mask=live)
                tl.store(out_ptr + 2 * j64 + 1, size.to(tl.int64), mask=live)
            else:
                issue(addr, size, MODE)

    @triton.jit
    def issue(addr, size, MODE: tl.constexpr):
        """A prefetch per element: addr (int64, a line's start) and, in MODE_BULK, size
        (int32 bytes, a multiple of 16)."""
        if MODE == 2:
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        else:
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip

    @triton.jit(noinline=True)
    def prefetch_share(ptr, nbytes, part, parts, MODE: tl.constexpr, CHUNK: tl.constexpr):
        """Inside a persistent kernel: item `part` of a phase's `parts` items prefetches its
        share of the nbytes at ptr (the phase's weights), so that the phase's items,
        taken while the phase before still runs, start its weights towards L2 before they
        wait. Whole lines, inside the tensor's allocation, CHUNK (chunk_bytes(MODE)) bytes
        an instruction; MODE 0: nothing."""
        if MODE != 0:
            base = ptr.to(tl.int64, bitcast=True)
            nbytes = nbytes.to(tl.int64)  # x part below: past int32 at 16 MB x 256 items
            end = (nbytes + 127) // 128 * 128
            lo = (nbytes * part // parts) // 128 * 128
            hi = tl.minimum((nbytes * (part + 1) // parts + 127) // 128 * 128, end)
            for first in range(lo, hi, 32 * CHUNK):
                offs = first + tl.arange(0, 32).to(tl.int64) * CHUNK
                offs = tl.where(offs < hi, offs, lo)  # dead lanes repeat the first chunk
                issue(base + offs, tl.minimum(hi - offs, CHUNK).to(tl.int32), MODE)


def plan_prefetch(ranges: list[tuple[int, int]], mode: int, out: torch.Tensor,
                  chunk: int | None = None) -> Launch:  # fmt: skip
    """One launch over up to MAX_RANGES (start, bytes) ranges (line-aligned). `out`: where
    MODE_RECORD writes (int64 [chunks, 2]); any int64 tensor otherwise. `chunk`: bytes a
    chunk (the mode's by default; MODE_RECORD takes either mode's to check its addressing)."""
    if not 0 < len(ranges) <= MAX_RANGES:
        raise ValueError(f"l2 prefetch: 1 to {MAX_RANGES} ranges, got {len(ranges)}")
    chunk = chunk_bytes(mode) if chunk is None else chunk
    if any(a % LINE or n % LINE or n <= 0 for a, n in ranges):
        raise ValueError(f"l2 prefetch: ranges must be whole {LINE}-byte lines: {ranges}")
    padded = list(ranges) + [ranges[0]] * (MAX_RANGES - len(ranges))
    counts = [-(-n // chunk) if i < len(ranges) else 0 for i, (_, n) in enumerate(padded)]
    total = sum(counts)
    args = [v for (a, _), c in zip(padded, counts, strict=True) for v in (a, c)]
    args += [a + n for a, n in padded]
    return Launch(
        name=f"l2_prefetch mode={mode} chunk={chunk}",
        kernel=_l2_prefetch_fwd,
        grid=(max(1, min(MAX_PROGRAMS, -(-total // BLOCK))),),
        args=(*args, out),
        constexprs={"CHUNK": chunk, "BLOCK": BLOCK, "MODE": mode},
        num_warps=4,
        num_stages=1,
    )


def chunks(ranges: list[tuple[int, int]], chunk: int) -> int:
    """How many chunks (prefetch instructions) the ranges take."""
    return sum(-(-n // chunk) for _, n in ranges)


def prefetch_kernel(tensors: list[torch.Tensor], mode: int | None = None,
                    chunk: int | None = None) -> torch.Tensor | None:  # fmt: skip
    """Prefetch the tensors' bytes into L2 (CUDA), MAX_RANGES a launch, on the current
    stream. MODE_RECORD (CPU tensors under the interpreter too) -> the chunks issued, int64
    [chunks, 2] (address, bytes), `chunk` bytes each; else None."""
    if triton is None:
        raise RuntimeError("the L2 prefetch kernel needs triton, which is not installed")
    ranges = line_ranges(tensors)
    if not ranges:
        return None
    device = tensors[0].device
    mode = mode_for(device) if mode is None else mode
    chunk = chunk_bytes(mode) if chunk is None else chunk
    record = mode == MODE_RECORD
    if record:
        out = torch.empty(chunks(ranges, chunk), 2, dtype=torch.int64, device=device)
    else:
        out = _unused(device)
    done = 0
    for i in range(0, len(ranges), MAX_RANGES):
        part = ranges[i : i + MAX_RANGES]
        plan_prefetch(part, mode, out[done:] if record else out, chunk).run()
        done += chunks(part, chunk)
    return out if record else None


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _unused(device: torch.device) -> torch.Tensor:
    """The GPU modes' `out` argument (never written): one per device, made on the first
    call (a warmup's, before any graph capture), so a captured launch allocates nothing."""
    if device not in _UNUSED:
        _UNUSED[device] = torch.empty(1, 2, dtype=torch.int64, device=device)
    return _UNUSED[device]


def prefetch_l2(tensors: list[torch.Tensor]) -> bool:
    """Dispatch: prefetch on CUDA (a hint: nothing else changes) -> whether it was issued.
    Elsewhere, or where Triton cannot build the kernel, nothing is done: a prefetch is never
    needed for a result."""
    if not tensors or not use_kernel(tensors[0]) or torch.version.hip:
        return False
    return try_kernel("l2_prefetch", _issue, tensors) is not None


def _issue(tensors: list[torch.Tensor]) -> bool:
    prefetch_kernel(tensors)
    return True


def pi05_launches() -> list[Launch]:
    """Both GPU modes over a layer's worth of ranges (for kernels/offline_compile.py)."""
    base = 1 << 40  # an aligned address: the launch is compiled, never run
    ranges = [(base, 4_194_304), (base + (8 << 20), 16_777_216)]
    out = torch.empty(1, 2, dtype=torch.int64, device="meta")
    return [plan_prefetch(ranges, mode, out) for mode in (MODE_LINE, MODE_BULK)]
