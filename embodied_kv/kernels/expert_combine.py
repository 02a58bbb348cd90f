"""The expert attention's reduce done inside its own kernel (kernels/expert_attention.py): a
tile's split partials combined, as decode_splitk's reduce combines them, in split order.

Two callers: FUSED_REDUCE (the last split of a tile combines all of its columns) and QUEUE
(a persistent launch whose reduce items each combine QUEUE_COLS columns of a tile once its
splits have arrived: kernels/work_queue.py).
"""

from __future__ import annotations

from embodied_kv.kernels.triton_base import tl, triton

COMBINE_D = 64  # columns combined at a time: a [64, 64] fp32 total (a whole D of 256 spilled)
QUEUE_COLS = 32  # columns of a tile per reduce item of the queue (8 items a tile at D = 256)


def reduce_items(block_d: int) -> int:
    """A tile's reduce items in the queue: its columns in chunks of QUEUE_COLS."""
    return max(1, block_d // QUEUE_COLS)


if triton is not None:
    from embodied_kv.kernels.work_queue import arrive, wait_for

    @triton.jit(noinline=True)
    def reduce_item(
        m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr, tk, part, n_tiles, n_kv, h_len, n_heads,
        stride_on, stride_oh, err_ptr, max_spins, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr, REDUCE_ITEMS: tl.constexpr, QUEUE_COLS: tl.constexpr,
    ):  # fmt: skip
        """A queue's reduce item: columns [part, part + 1) x QUEUE_COLS of tile tk (T =
        n_tiles (tile, KV head) pairs), once its NUM_SPLITS partials have arrived. count_ptr
        holds the T arrival counters, then the T reduce-items-done counters; the tile's last
        reduce item puts both back to 0 (every wait on them has passed). A call, not inlined:
        inlined in the attention's queue with RoPE it spilled 8 bytes at sm_90."""
        wait_for(count_ptr + tk, NUM_SPLITS, err_ptr, max_spins)
        combine_splits(
            m_ptr, l_ptr, acc_ptr, out_ptr, tk // n_kv, tk % n_kv, h_len, n_heads, stride_on,
            stride_oh, part * QUEUE_COLS, GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM, NUM_SPLITS,
            QUEUE_COLS, QUEUE_COLS,
        )  # fmt: skip
        if arrive(count_ptr + n_tiles + tk) == REDUCE_ITEMS - 1:
            tl.atomic_xchg(count_ptr + tk, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(count_ptr + n_tiles + tk, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def tile_rows(tile_m, kv_head, h_len, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr):  # fmt: skip
        """(tok, heads, live) of the tile's [BLOCK_M * GROUP_PAD] rows: row r is suffix token
        r // GROUP_PAD, query head r % GROUP_PAD of the KV head."""
        offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
        tok = tile_m.to(tl.int64) * BLOCK_M + offs_r // GROUP_PAD
        g = offs_r % GROUP_PAD
        return tok, kv_head.to(tl.int64) * GROUP + g, (tok < h_len) & (g < GROUP)

    @triton.jit(noinline=True)
    def combine_splits(
        m_ptr,  # [H, Hq, NUM_SPLITS] fp32 max per split
        l_ptr,  # [H, Hq, NUM_SPLITS] fp32 denominator per split
        acc_ptr,  # [H, Hq, NUM_SPLITS, D] fp32 unnormalised output per split
        out_ptr,  # [H, Hq, D] output
        tile_m,  # the tile's suffix tokens: [tile_m * BLOCK_M, (tile_m + 1) * BLOCK_M)
        kv_head,  # its KV head
        h_len,  # H
        n_heads,  # Hq
        stride_on,  # out stride over tokens
        stride_oh,  # out stride over heads
        d_lo,  # first column combined
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        D_COLS: tl.constexpr,  # columns [d_lo, d_lo + D_COLS) are combined
        CHUNK: tl.constexpr,  # of them, combined at a time (a power of two)
    ):
        # Not inlined: its loop invariants are not hoisted into the caller's loop (the queue's
        # items), which spilled at sm_90. decode_splitk's reduce for a tile, same operations
        # in the same order: the weighted outputs summed in split order 0, 1, ... (a loop,
        # one [ROWS, CHUNK] tile live), the denominators with tl.sum over the [ROWS,
        # NUM_SPLITS] tile. Loads from L2 (.cg), where the other SMs' partials are.
        tok, heads, live_r = tile_rows(tile_m, kv_head, h_len, GROUP, GROUP_PAD, BLOCK_M)
        part = (tok * n_heads + heads) * NUM_SPLITS  # [ROWS] split 0's workspace row
        offs_s = tl.arange(0, NUM_SPLITS)
        m = tl.load(
            m_ptr + part[:, None] + offs_s[None, :],
            mask=live_r[:, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [ROWS, NUM_SPLITS]
        l_s = tl.load(
            l_ptr + part[:, None] + offs_s[None, :],
            mask=live_r[:, None],
            other=1.0,  # padded rows: a finite quotient, never stored
            cache_modifier=".cg",
        )
        m_max = tl.max(m, 1)  # finite: the suffix split sees H >= 1 keys
        denom = tl.sum(l_s * tl.exp2(m - m_max[:, None]), 1)
        for d0 in range(d_lo, d_lo + D_COLS, CHUNK):
            cols = d0 + tl.arange(0, CHUNK)
            mask = live_r[:, None] & (cols < HEAD_DIM)[None, :]
            total = tl.zeros([BLOCK_M * GROUP_PAD, CHUNK], dtype=tl.float32)
            for s in range(NUM_SPLITS):
                m_s = tl.load(m_ptr + part + s, mask=live_r, other=0.0, cache_modifier=".cg")
                a = tl.load(
                    acc_ptr + (part + s)[:, None] * HEAD_DIM + cols[None, :],
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
                total += a * tl.exp2(m_s - m_max)[:, None]
            tl.store(
                out_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh + cols[None, :],
                (total / denom[:, None]).to(out_ptr.dtype.element_ty),
                mask=mask,
            )
