"""Packed attention: one flat batch of new tokens, each reading its own slot of the arena.

Contract (shared by the reference and the Triton kernel):

    q        [N, Hq, D]      queries of the new tokens (RoPE applied)
    k_cache  [S, T, Hkv, D]  one layer of the arena; the new tokens' K are already written
    v_cache  [S, T, Hkv, D]
    slot     [N] int64       the slot each token belongs to
    kv_len   [N] int64       token i attends to rows [0, kv_len[i]) of k_cache[slot[i]]
    out      [N, Hq, D]      in q.dtype, accumulated in fp32

Causal decode, a bidirectional prefix and mixed batches differ only in kv_len, which
the step planner (storage/step.py) computes. Hq must be a multiple of Hkv (MQA / GQA).

The reference is also the CPU hot path, so it is written to be batch-invariant: the
result for a token does not depend on which other tokens share the step. CPU fp32
GEMMs round differently for small row counts: on the AMD EPYC CI machine (torch 2.13 CPU,
one or two threads) rows 1..3 disagree with >= 4 rows, an earlier torch build disagreed at
1..11 except 4 and 8, and an Intel Xeon (the H100 machine's host, MKL) at 1..15 with any
thread count. So ROW_BUCKET is probed once per process (`probe_row_bucket`: the smallest
power of two whose multiples all agree with a 64-row GEMM, at one thread and at the
process's count; 4 on the CI machine) or set with EMBODIED_KV_ROW_BUCKET. `bench step`
records the probe over the model's own shapes. A step is padded once to a
multiple of ROW_BUCKET tokens (storage/step.py); inside attention a run of n tokens of one
slot is [n * group, D] query rows (the query heads of a kv head folded into rows), padded
only where n * group < ROW_BUCKET. Runs with the same (tokens, key bucket) go through one
batched `scaled_dot_product_attention` call (a batch entry rounds as it does alone, checked
by test/kernels) and keys are padded to a multiple of KEY_BLOCK; masked keys contribute
exact zeros. So a decode of B slots is a few batched calls, not B runs padded to 16 rows.
The grouping, gather indices and masks (`plan_ref`) depend only on the runs and kv_len, so
the backbone makes them once per step and every layer with the same lengths reuses them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embodied_kv.kernels.decode_splitk import plan_splitk
from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.prefill_tile import plan_tile
from embodied_kv.kernels.triton_base import (  # triton is None where it is not installed
    INTERPRETED,
    KERNEL_DTYPES,
    MAX_GROUP,
    MAX_HEAD_DIM,
    Launch,
    as_dtype,
    triton,
    use_kernel,
)

ROW_BUCKETS = (4, 8, 16, 32)  # candidates, smallest first
PROBE_SHAPES = ((64, 64), (256, 64), (64, 256), (1024, 256), (256, 1024))  # [out, in] fp32


def probe_row_bucket(shapes=PROBE_SHAPES, ref_rows: int = 64) -> int:
    """The smallest ROW_BUCKETS entry b such that, for every shape, a CPU fp32 GEMM of any
    multiple of b rows equals the same rows of a ref_rows GEMM, bit for bit, at one thread
    and at the current thread count (~30 ms). The largest candidate if none is."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    bad: set[int] = set()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            for n_out, n_in in shapes:
                w = torch.randn(n_out, n_in, generator=g)
                x = torch.randn(ref_rows, n_in, generator=g)
                ref = F.linear(x, w)
                same = [torch.equal(F.linear(x[:m], w), ref[:m]) for m in range(1, ref_rows)]
                bad |= {m for m, ok in enumerate(same, start=1) if not ok}
    finally:
        torch.set_num_threads(threads)
    return next((b for b in ROW_BUCKETS if not any(m % b == 0 for m in bad)), ROW_BUCKETS[-1])


def _row_bucket() -> int:
    given = os.environ.get("EMBODIED_KV_ROW_BUCKET", "")
    if not given:
        return probe_row_bucket()
    if not given.isdigit() or int(given) not in ROW_BUCKETS:
        raise ValueError(f"EMBODIED_KV_ROW_BUCKET={given!r}: use one of {ROW_BUCKETS}")
    return int(given)


ROW_BUCKET = _row_bucket()  # tokens per step and GEMM rows per run are padded to a multiple
KEY_BLOCK = 64  # keys per run are padded to a multiple of this
# On a CUDA arena the probe's reason does not hold: it is about the host CPU's fp32 GEMMs
# (on the H100 machine's Xeon it gave 32: every decode padded to 32 rows, logits
# [32, 257152] fp32, 33 MB a step). CUDA results are not made batch-invariant by padding
# (cuBLAS picks its kernel per shape), and eager and graph steps agree through the graph
# buckets (engine/graphs.py STEP_BUCKETS, all multiples of 8), not through this size. 8 is
# the smallest side of a tensor-core MMA (m16n8k16; skinny GEMMs put the tokens on it), so
# fewer rows would not save a cycle, and it keeps the LM head at [8, V] for up to 8 slots.
CUDA_ROW_BUCKET = 8


def row_bucket(device: torch.device | str) -> int:
    """Tokens a packed step on `device` is padded to a multiple of: ROW_BUCKET (the host
    CPU's probe) on the CPU, CUDA_ROW_BUCKET on CUDA."""
    return CUDA_ROW_BUCKET if torch.device(device).type == "cuda" else ROW_BUCKET


Run = tuple[int, int, int]  # (slot, first token index, number of tokens)


def bucket(n: int, size: int = ROW_BUCKET) -> int:
    """Smallest multiple of `size` that holds n (at least one bucket)."""
    return max(size, -(-n // size) * size)


def run_rows(n: int, group: int) -> int:
    """Query rows a run of n tokens is padded to, so that its [rows * group, D] GEMM has a
    batch-invariant row count (a multiple of ROW_BUCKET): n itself whenever group is."""
    rows = n
    while (rows * group) % ROW_BUCKET:
        rows += 1
    return rows


def contiguous_runs(slot: torch.Tensor) -> list[Run]:
    """Split a flat slot vector into runs of equal consecutive slots (host sync)."""
    values, counts = torch.unique_consecutive(slot.cpu(), return_counts=True)
    runs, start = [], 0
    for s, c in zip(values.tolist(), counts.tolist(), strict=True):
        runs.append((s, start, c))
        start += c
    return runs


def check_shapes(q, k_cache, v_cache, slot, kv_len) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [N,Hq,D] and k/v [S,T,Hkv,D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv != 0:
        raise ValueError(f"head_dim {d} vs {k_cache.shape[3]}, Hq={hq} not a multiple of Hkv={hkv}")
    if slot.shape != (n,) or kv_len.shape != (n,):
        raise ValueError(f"slot {tuple(slot.shape)} and kv_len {tuple(kv_len.shape)} must be [{n}]")


@dataclass(frozen=True)
class RunGroup:
    """Runs with the same (tokens, key bucket): one batched sdpa call."""

    n: int  # tokens per run
    t: int  # keys each run reads, a KEY_BLOCK multiple (masked past its kv_len)
    index: slice | torch.Tensor  # the runs' tokens in the step: a slice (one run) or [G * n]
    slot: slice | torch.Tensor  # the slots: s:s+1 for one run (a view), else [G] int64
    mask: torch.Tensor  # [G, 1, R, t] fp32: 0 where query row r reads key j, -inf elsewhere


@dataclass(frozen=True)
class RefPlan:
    """What the reference derives from one layer's host metadata (runs, kv_len), built once
    per step and shared by every layer that reads the same lengths: per layer only the
    gathers, the sdpa calls and the scatter remain (a tiny decode step is Python-bound)."""

    groups: tuple[RunGroup, ...]
    covered: int  # tokens in some run; the others (a step's padding) get zeros


def plan_ref(
    runs: list[Run],
    kv_len: torch.Tensor,
    kv_len_host: torch.Tensor,
    group: int,
    t_max: int,
) -> RefPlan:
    """Group `runs` by (tokens, key bucket) and build their masks from kv_len [N] (on the
    device of the attention; `kv_len_host` is its CPU copy, read for the buckets).

    The masks are the additive form sdpa turns a boolean mask into (0 / -inf in fp32), so the
    bytes are those of a boolean mask. A run of n tokens is `run_rows(n, group)` query rows;
    rows past n (padding) read key 0 only and are dropped."""
    lens = kv_len_host.tolist()
    by_shape: dict[tuple[int, int], list[Run]] = {}
    for run in runs:
        _, start, n = run
        t = min(t_max, bucket(max(lens[start : start + n]), KEY_BLOCK))
        by_shape.setdefault((n, t), []).append(run)
    dev = kv_len.device
    groups = []
    for (n, t), same in by_shape.items():
        g, rows = len(same), run_rows(n, group)
        if g == 1:  # views, no gathers: a prefill, or a decode of one slot
            s, start, _ = same[0]
            index, slot = slice(start, start + n), slice(s, s + 1)
            run_lens = kv_len[index].unsqueeze(0)  # [1, n]
        else:
            slot = torch.tensor([s for s, _, _ in same], device=dev)
            index = torch.tensor([st + j for _, st, _ in same for j in range(n)], device=dev)
            run_lens = kv_len[index].view(g, n)
        if rows == 1:  # one token per run: a kv head's query heads are the rows
            keep = (torch.arange(t, device=dev) < run_lens).view(g, 1, 1, t)
        else:
            if rows > n:
                run_lens = torch.cat([run_lens, run_lens.new_ones(g, rows - n)], dim=1)
            keep = torch.arange(t, device=dev) < run_lens.unsqueeze(-1)  # [G, rows, t]
            keep = keep.unsqueeze(2).expand(g, rows, group, t).reshape(g, 1, rows * group, t)
        mask = torch.zeros(keep.shape, device=dev).masked_fill_(~keep, float("-inf"))
        groups.append(RunGroup(n, t, index, slot, mask))
    return RefPlan(tuple(groups), sum(n for _, _, n in runs))


def packed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
    plan: RefPlan | None = None,
) -> torch.Tensor:
    """Plain-torch packed attention. `runs` and `kv_len_host` (CPU copies the planner
    already has) avoid device syncs; without them they are derived here. `plan` (from
    `plan_ref` over the same runs and kv_len) skips the planning. Tokens in no run (a
    step's padding, which the planner leaves out) get zeros."""
    check_shapes(q, k_cache, v_cache, slot, kv_len)
    if plan is None:
        if runs is None:
            runs = contiguous_runs(slot)
        if kv_len_host is None:
            kv_len_host = kv_len.cpu()
        plan = plan_ref(runs, kv_len, kv_len_host, q.shape[1] // k_cache.shape[2], k_cache.shape[1])
    assert plan.covered <= q.shape[0]
    out = torch.empty_like(q) if plan.covered == q.shape[0] else torch.zeros_like(q)
    for grp in plan.groups:
        _attend_runs(q, k_cache, v_cache, scale, grp, out)
    return out


def _attend_runs(q, k_cache, v_cache, scale, grp: RunGroup, out) -> None:
    """Attention for the G runs of `grp`: one batched sdpa call.

    q [N, Hq, D] -> out rows of these runs; scores [G, Hkv, rows * group, t]."""
    _, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    g, n, t = grp.mask.shape[0], grp.n, grp.t
    rows = run_rows(n, group)
    qs = q[grp.index].view(g, n, hq, d)  # one run: a view; several: a gather
    k, v = k_cache[grp.slot, :t], v_cache[grp.slot, :t]  # [G, t, Hkv, D]
    qs, k, v = qs.float(), k.float().transpose(1, 2), v.float().transpose(1, 2)
    if rows == 1:  # [G, Hkv, group, D] -> [G*n, Hq, D]
        o = F.scaled_dot_product_attention(qs.view(g, hkv, group, d), k, v, grp.mask, scale=scale)
        o = o.view(g, hq, d)
    else:
        if rows > n:
            qs = torch.cat([qs, qs.new_zeros(g, rows - n, hq, d)], dim=1)
        qs = qs.view(g, rows, hkv, group, d).transpose(1, 2).reshape(g, hkv, rows * group, d)
        o = F.scaled_dot_product_attention(qs, k, v, grp.mask, scale=scale)
        o = o.view(g, hkv, rows, group, d).transpose(1, 2)[:, :n].reshape(g * n, hq, d)
    out[grp.index] = as_dtype(o, q.dtype)


# --- Triton kernel ----------------------------------------------------------------------
#
# Two kernels, one per access pattern, each correct for every input of the contract:
#   kernels/decode_splitk.py  split-K (flash-decoding) + reduce: few tokens, each reading a
#                             whole slot, spread over NUM_SPLITS programs per (token, KV head)
#   kernels/prefill_tile.py   BLOCK_M tokens × the query heads of one KV head per program: runs
#                             of one slot (prefill, mixed steps) read K/V once per tile
# `packed_attention_kernel` picks one without a host sync. The choice changes the speed and the
# rounding (summation orders differ), never the contract; each kernel alone is batch-invariant
# (a token's bytes do not depend on the other tokens of its step). Supported range:
# fp32 / bf16 / fp16, head_dim <= 256, Hq / Hkv <= 32, contiguous last dims (module headers).
#
# Every configuration pi05 uses (bf16, D = 256, 8 query heads per KV head) compiles for sm_90
# without spills: registers and shared memory per configuration in kernels/offline_compile.py.

SPLITK_MAX_TOKENS = 16  # default rule: steps of at most this many (padded) tokens use split-K


def check_kernel_inputs(q, k_cache, v_cache, slot, kv_len) -> None:
    """What the Triton kernels need beyond the contract: ValueError for mismatched inputs,
    RuntimeError for what they do not support. Shape and dtype checks only (no device sync)."""
    if triton is None:
        raise RuntimeError("packed_attention_kernel needs triton, which is not installed")
    check_shapes(q, k_cache, v_cache, slot, kv_len)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if slot.dtype.is_floating_point or kv_len.dtype.is_floating_point:
        raise ValueError(f"slot and kv_len must be integer, got {slot.dtype}, {kv_len.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, slot, kv_len)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    if q.dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"dtype {q.dtype} unsupported, expected one of {KERNEL_DTYPES}")
    group = q.shape[1] // k_cache.shape[2]
    if q.shape[2] > MAX_HEAD_DIM or group > MAX_GROUP:
        raise RuntimeError(
            f"head_dim {q.shape[2]} > {MAX_HEAD_DIM} or Hq/Hkv {group} > {MAX_GROUP}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise RuntimeError(
            f"last dim must be contiguous, strides {q.stride()}, {k_cache.stride()}, "
            f"{v_cache.stride()}"
        )


def plan_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    decode: bool | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    num_splits: int | None = None,
) -> list[Launch]:
    """The launches `packed_attention_kernel` makes; shapes only, so it plans on `meta` tensors
    too (kernels/offline_compile.py compiles exactly these)."""
    check_kernel_inputs(q, k_cache, v_cache, slot, kv_len)
    if out.shape != q.shape or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must be like q {tuple(q.shape)}")
    if decode is None:
        decode = q.shape[0] <= SPLITK_MAX_TOKENS
    if decode:
        return plan_splitk(q, k_cache, v_cache, slot, kv_len, scale, out, workspace, num_splits)
    return plan_tile(q, k_cache, v_cache, slot, kv_len, scale, out)


def packed_attention_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    decode: bool | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton packed attention; same contract as `packed_attention_ref`. Returns out [N, Hq, D].

    `decode` picks the kernel: True split-K, False the prefill tile, None by the step's size
    (N <= SPLITK_MAX_TOKENS: split-K). It is a host-side hint that must not change between
    replays of one CUDA graph: pass a value fixed per captured bucket (e.g. "every segment has
    n == 1", which the planner knows) or None, which depends on N alone, so an eager step and a
    graph step of one padded size take the same kernel. Any hint gives a correct result.
    `out` (q's dtype, last dim contiguous) and `workspace` (decode_splitk.workspace, split-K
    only) let a graph use static buffers; without them they are allocated per call.
    `num_splits` overrides the split-K configuration (tests)."""
    if not (q.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"packed_attention_kernel runs on CUDA (or on CPU with TRITON_INTERPRET=1 set "
            f"before this module is imported), got {q.device}"
        )
    if out is not None and out.dtype != q.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from q's {q.dtype}")
    result = torch.empty_like(q) if out is None else out
    # The interpreter truncates fp32 -> 16-bit casts (triton 3.9) where GPUs round to nearest
    # even, so under it the kernels write fp32 and torch rounds.
    target = result.float() if INTERPRETED and q.dtype != torch.float32 else result
    for launch in plan_kernel(
        q, k_cache, v_cache, slot, kv_len, scale, target, decode, workspace, num_splits
    ):
        if q.shape[0] > 0:
            launch.run()
    if target is not result:
        result.copy_(target)
    return result


def packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    plan: RefPlan | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernels on CUDA (into `out` when given), the reference elsewhere
    (with `plan` when the caller made one for these runs and lengths)."""
    if use_kernel(q, k_cache, v_cache):
        o = try_kernel("packed_attention", packed_attention_kernel, q, k_cache, v_cache, slot,
                       kv_len, scale, out=out)  # fmt: skip
        if o is not None:
            return o
    o = packed_attention_ref(q, k_cache, v_cache, slot, kv_len, scale, runs, kv_len_host, plan)
    return o if out is None else out.copy_(o)
