"""Tiled packed attention: the prefill / mixed-step access pattern.

A prefill is many consecutive tokens of one slot. A program here takes BLOCK_M consecutive
tokens of the flat step × the GROUP query heads of one KV head as one [BLOCK_M * GROUP_PAD,
BLOCK_D] query tile, so each K/V row is read once per tile instead of once per token (8x fewer
reads at pi05: 8 tokens × 8 heads per tile). Online softmax (flash-attention) over the slot's
rows; the per-token kv_len mask covers both a bidirectional prefix (equal kv_len within the
segment) and causal decode or prefill (kv_len growing by one). Same contract as
`packed_attention_ref` (kernels/packed_attention.py); inputs are validated there.

Supported range: q / k / v fp32, bf16 or fp16 (one dtype), head_dim <= 256 (padded to a power
of two >= 16 with masks), Hq / Hkv <= 32, any strides with a contiguous last dim, slots in any
order and any interleaving. Preconditions not checked (a check would sync the device):
1 <= kv_len[i] <= T, 0 <= slot[i] < S.

CUDA graphs: the grid is (cdiv(N, BLOCK_M), Hkv) over the flat token array, fixed by the
step's padded size, never by where runs start (host-side run boundaries change between replays
of one graph). A block may hold tokens of several slots — a run boundary, decode tokens of a
mixed step, shuffled slots — so each program loops over the distinct slots of its block, the
smallest unprocessed slot first: one pass reads that slot's rows for the tokens that belong to
it and stores only theirs (the others read row 0 and are discarded). A block of one run, the
prefill case, takes one pass. A pass's result for a token depends only on that token's q, slot
and kv_len: blocks past its kv_len leave its state bit-identical (see attend_block), so the
output is the same bytes whatever shares the step (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels.decode_splitk import MAX_SPLITS, MIN_SPLITS, plan_reduce, workspace
from embodied_kv.kernels.triton_base import LOG2E, Launch, pow2, precision_flags, tl, triton

# Programs over each token's keys (issue 33 item 3): at pi05 a 663-row prefix is 88 tiles of
# 64 rows on 132 SMs, each walking 42 key blocks in a chain (_prefill_tile_fwd 43.5 us a
# call on an H100, 0.8 ms an action). Split in 2, with tiles of 32 rows (TILE_ROWS_SPLIT: the
# 64-row tile's fp32 partials spilled at sm_90, 132 bytes), it is 352 programs of 21 blocks,
# then decode_splitk's reduce (fp32 partials, 11.5 MB at 704 rows). Untimed on a GPU: `bench
# latency` times 1 beside it (graphs_unsplit) and says LOSS if the split loses.
KEY_SPLITS = 2
TILE_ROWS = 64  # query rows (tokens × padded group) per program, 16-bit inputs
TILE_ROWS_SPLIT = 32  # the same with key splits: 208 registers, mma.sync, no spills
TILE_ROWS_FP32 = 32  # fp32 (ieee dots on CUDA cores) holds half the rows in registers


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tokens per tile
    group_pad: int  # GROUP rounded up to a power of two (no minimum: rows = block_m * group_pad)
    block_n: int  # keys per online-softmax step
    num_warps: int
    num_stages: int


def tile_config(dtype: torch.dtype, group: int, key_splits: int = 1) -> TileConfig:
    """BLOCK_M × GROUP_PAD = TILE_ROWS query rows: at pi05 (group 8) 8 tokens per tile; with
    key splits TILE_ROWS_SPLIT (4 tokens: 208 / 0 / 34 KiB, the partials stored in fp32).

    sm_90, bf16, D = 256, group 8 (ptxas of triton 3.9, registers per thread / spilled bytes /
    shared memory): 64 rows take wgmma, and with P @ V split in hi + lo (attend_block) fit
    only at BLOCK_N = 16, 4 warps: 247 / 0 / 64 KiB; BLOCK_N = 32 spills at 4 or 8 warps
    (8 warps, 2 stages: 255 / 188 / 100 KiB). 32 rows fall back to mma.sync (BLOCK_N = 32,
    8 warps: 153 / 0 / 52 KiB) and read K/V once per 4 tokens instead of 8. Rounding P to
    bf16 once instead (64 rows, BLOCK_N = 32, 8 warps: 202 / 0) raised the mean error to
    1.6x the bf16 reference's (interpreter, pi05 heads). fp32 (ieee dots, no tensor cores):
    32 rows, BLOCK_N = 16, 8 warps: 128 / 0 / 66 KiB; BLOCK_N = 32 spills at 4 or 8 warps."""
    fp32 = dtype == torch.float32
    rows = TILE_ROWS_FP32 if fp32 else TILE_ROWS if key_splits == 1 else TILE_ROWS_SPLIT
    group_pad = pow2(group, 1)
    block_m = max(1, rows // group_pad)  # group 32 keeps 2 tokens: rows >= 16 for tl.dot
    return TileConfig(block_m, group_pad, block_n=16, num_warps=8 if fp32 else 4, num_stages=2)


def tile_constexprs(cfg: TileConfig, group: int, d: int, dtype: torch.dtype) -> dict:
    """The constexprs of a [BLOCK_M tokens x GROUP_PAD heads] query-tile kernel (this one
    and kernels/expert_attention.py)."""
    return {
        "GROUP": group,
        "GROUP_PAD": cfg.group_pad,
        "BLOCK_M": cfg.block_m,
        "HEAD_DIM": d,
        "BLOCK_D": pow2(d),
        "BLOCK_N": cfg.block_n,
        **precision_flags(dtype),
    }


if triton is not None:
    from embodied_kv.kernels.triton_base import attend_block, load_kv_block

    @triton.jit
    def _prefill_tile_fwd(
        q_ptr,  # [N, Hq, D] queries
        k_ptr,  # [S, T, Hkv, D] keys of one layer of the arena
        v_ptr,  # [S, T, Hkv, D] values, same layout as keys
        slot_ptr,  # [N] int slot of each token
        kv_len_ptr,  # [N] int number of rows of its slot each token reads
        out_ptr,  # [N, Hq, D] output (NUM_SPLITS == 1)
        m_ptr,  # [N, Hq, NUM_SPLITS] fp32 out: max score per split (NUM_SPLITS > 1)
        l_ptr,  # [N, Hq, NUM_SPLITS] fp32 out: softmax denominator per split
        acc_ptr,  # [N, Hq, NUM_SPLITS, D] fp32 out: unnormalised output per split
        n_tok,  # N
        qk_scale,  # softmax scale * log2(e)
        stride_qn,  # q stride over tokens (elements)
        stride_qh,  # q stride over heads
        stride_ks,  # k stride over slots
        stride_kt,  # k stride over rows
        stride_kh,  # k stride over kv heads
        stride_vs,  # v stride over slots
        stride_vt,  # v stride over rows
        stride_vh,  # v stride over kv heads
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        GROUP: tl.constexpr,  # Hq // Hkv
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
        BLOCK_M: tl.constexpr,  # tokens per tile; BLOCK_M * GROUP_PAD >= 16
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_D: tl.constexpr,  # D rounded up to a power of two >= 16
        BLOCK_N: tl.constexpr,  # keys per online-softmax step
        SPLIT_P: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        NUM_SPLITS: tl.constexpr,  # programs over each token's keys (1: the output directly)
    ):
        # Grid (cdiv(N, BLOCK_M), Hkv, NUM_SPLITS): program (b, h, j) owns tokens
        # [b*BLOCK_M, (b+1)*BLOCK_M) and the query heads of KV head h, and chunk j of each
        # token's keys. Tile row r = (token r // GROUP_PAD, head r % GROUP_PAD).
        kv_head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        tok = tl.program_id(0).to(tl.int64) * BLOCK_M + offs_r // GROUP_PAD  # [ROWS]
        g = offs_r % GROUP_PAD
        in_step = tok < n_tok
        mask_d = offs_d < HEAD_DIM
        live = (in_step & (g < GROUP))[:, None] & mask_d[None, :]  # [ROWS, BLOCK_D]
        heads = kv_head * GROUP + g
        slot = tl.load(slot_ptr + tok, mask=in_step, other=0).to(tl.int32)  # [ROWS]
        lens = tl.load(kv_len_ptr + tok, mask=in_step, other=1).to(tl.int32)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
            mask=live,
            other=0.0,
        )  # [ROWS, BLOCK_D]; padded rows see q = 0: finite scores, no NaN

        todo = in_step
        while tl.max(todo.to(tl.int32), 0) > 0:  # one pass per distinct slot of the block
            s = tl.min(tl.where(todo, slot, 2147483647), 0)
            member = todo & (slot == s)
            n_row = tl.where(member, lens, 1)  # others read row 0 of s (valid), never stored
            # this split's keys of each row: whole BLOCK_N blocks from its own kv_len only, so
            # a token's bytes do not depend on the tokens beside it (block-aligned chunks)
            chunk = tl.cdiv(tl.cdiv(n_row, BLOCK_N), NUM_SPLITS) * BLOCK_N  # [ROWS]
            lo = split * chunk
            hi = tl.minimum(lo + chunk, n_row)  # lo >= hi: an empty split of that row
            first = tl.min(tl.where(member, lo, 2147483647), 0)  # a multiple of BLOCK_N
            n_keys = tl.max(tl.where(member, hi, 0), 0)
            k_base = k_ptr + s.to(tl.int64) * stride_ks + kv_head * stride_kh
            v_base = v_ptr + s.to(tl.int64) * stride_vs + kv_head * stride_vh
            m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
            for block in range(first, n_keys, BLOCK_N):
                rows = block + offs_n
                k, v = load_kv_block(
                    k_base, v_base, rows, n_keys, offs_d, mask_d, stride_kt, stride_vt
                )  # [BLOCK_D, BLOCK_N], [BLOCK_N, BLOCK_D]
                valid = (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])
                m_i, l_i, acc = attend_block(
                    q, k, v, valid, m_i, l_i, acc, qk_scale,
                    SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
            if NUM_SPLITS == 1:
                out = acc / l_i[:, None]
                tl.store(
                    out_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh
                    + offs_d[None, :],
                    out.to(out_ptr.dtype.element_ty),
                    mask=live & member[:, None],
                )  # fmt: skip
            else:  # decode_splitk's partial layout, combined by its reduce
                part = (tok * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
                keep = in_step & (g < GROUP) & member
                tl.store(m_ptr + part, m_i, mask=keep)
                tl.store(l_ptr + part, l_i, mask=keep)
                tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                         mask=live & member[:, None])  # fmt: skip
            todo = todo & (slot != s)


def plan_tile(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [S, T, Hkv, D]
    v_cache: torch.Tensor,
    slot: torch.Tensor,  # [N]
    kv_len: torch.Tensor,  # [N]
    scale: float,
    out: torch.Tensor,  # [N, Hq, D]
    key_splits: int | None = None,  # KEY_SPLITS if None; 1, or a power of two in [2, 32]
) -> list[Launch]:
    """The launches of a tiled attention call (inputs already validated): the tile, and with
    key splits decode_splitk's reduce over its partials (allocated here: a graph's own)."""
    n_tok, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    splits = KEY_SPLITS if key_splits is None else key_splits
    if splits != 1 and (splits < MIN_SPLITS or splits & (splits - 1) or splits > MAX_SPLITS):
        raise ValueError(f"key_splits={splits}: 1 or a power of two in [2, {MAX_SPLITS}]")
    cfg = tile_config(q.dtype, group, splits)
    m, l_s, acc = workspace(n_tok, hq, d, splits, q.device) if splits > 1 else (out,) * 3
    name = (
        f"prefill_tile {str(q.dtype).removeprefix('torch.')} D={d} group={group} "
        f"block_m={cfg.block_m} block_n={cfg.block_n} key_splits={splits}"
    )
    tile = [
        Launch(
            name=name,
            kernel=_prefill_tile_fwd,
            grid=(-(-n_tok // cfg.block_m), hkv, splits),
            args=(
                q,
                k_cache,
                v_cache,
                slot,
                kv_len,
                out,
                m,
                l_s,
                acc,
                n_tok,
                scale * LOG2E,
                q.stride(0),
                q.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                v_cache.stride(0),
                v_cache.stride(1),
                v_cache.stride(2),
                out.stride(0),
                out.stride(1),
            ),
            constexprs={**tile_constexprs(cfg, group, d, q.dtype), "NUM_SPLITS": splits},
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    ]
    if splits == 1:
        return tile
    tag = f"{str(q.dtype).removeprefix('torch.')} D={d} group={group} splits={splits}"
    return [*tile, plan_reduce(m, l_s, acc, out, f"prefill_reduce {tag}")]
