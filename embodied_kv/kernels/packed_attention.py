"""Packed attention: one flat batch of new tokens, each reading its own slot of the arena.

Contract (shared by the reference and the Triton kernel):

    q        [N, Hq, D]      queries of the new tokens (RoPE applied)
    k_cache  [S, T, Hkv, D]  one layer of the arena; the new tokens' K are already written
    v_cache  [S, T, Hkv, D]
    slot     [N] int64       the slot each token belongs to
    kv_len   [N] int64       token i attends to rows [0, kv_len[i]) of k_cache[slot[i]]
    out      [N, Hq, D]      in q.dtype, accumulated in fp32

Causal decode, a bidirectional prefix and mixed batches differ only in kv_len, which
the step planner (kv/step.py) computes. Hq must be a multiple of Hkv (MQA / GQA).

The reference is also the CPU hot path, so it is written to be batch-invariant: the
result for a token does not depend on which other tokens share the step. CPU fp32
GEMMs round differently for small row counts (measured: M in 1..11 except 4 and 8
disagree with M >= 12), so each run of a slot is padded to ROW_BUCKET query rows and
its keys to a multiple of KEY_BLOCK; masked keys contribute exact zeros.
"""

from __future__ import annotations

import torch

ROW_BUCKET = 16  # query rows per run are padded to a multiple of this (>= 12 is batch-invariant)
KEY_BLOCK = 64  # keys per run are padded to a multiple of this

Run = tuple[int, int, int]  # (slot, first token index, number of tokens)


def bucket(n: int, size: int = ROW_BUCKET) -> int:
    """Smallest multiple of `size` that holds n (at least one bucket)."""
    return max(size, -(-n // size) * size)


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


def packed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch packed attention. `runs` and `kv_len_host` (CPU copies the planner
    already has) avoid device syncs; without them they are derived here."""
    check_shapes(q, k_cache, v_cache, slot, kv_len)
    if runs is None:
        runs = contiguous_runs(slot)
    if kv_len_host is None:
        kv_len_host = kv_len.cpu()
    n_tok, hq, d = q.shape
    t_max, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q)
    for s, start, n in runs:
        lens = kv_len[start : start + n]
        t = min(t_max, bucket(int(kv_len_host[start : start + n].max()), KEY_BLOCK))
        rows = bucket(n)
        qs = q.new_zeros((rows, hq, d), dtype=torch.float32)
        qs[:n] = q[start : start + n]
        qs = qs.view(rows, hkv, group, d).permute(1, 0, 2, 3).reshape(hkv, rows * group, d)
        k = k_cache[s, :t].float().permute(1, 2, 0)  # [Hkv, D, t]
        v = v_cache[s, :t].float().permute(1, 0, 2)  # [Hkv, t, D]
        scores = torch.matmul(qs, k) * scale  # [Hkv, rows*group, t]
        keep = torch.ones(rows, dtype=lens.dtype, device=lens.device)
        keep[:n] = lens
        masked = torch.arange(t, device=q.device)[None, :] >= keep[:, None]  # [rows, t]
        masked = masked.repeat_interleave(group, dim=0)
        scores = scores.masked_fill(masked[None], float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, rows*group, D]
        o = o.view(hkv, rows, group, d).permute(1, 0, 2, 3).reshape(rows, hq, d)
        out[start : start + n] = o[:n].to(q.dtype)
    assert sum(n for _, _, n in runs) == n_tok
    return out


def packed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    runs: list[Run] | None = None,
    kv_len_host: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if q.is_cuda:
        from embodied_kv.kernels.packed_attention_triton import packed_attention_kernel

        return packed_attention_kernel(q, k_cache, v_cache, slot, kv_len, scale)
    return packed_attention_ref(q, k_cache, v_cache, slot, kv_len, scale, runs, kv_len_host)
