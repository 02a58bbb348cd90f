"""One program's work in the expert attention (kernels/expert_attention.py): a split of a
tile of suffix queries -> its partial (max, sum, unnormalised output) in the workspace; and
the suffix keys' rotation, which that split does first with RoPE on load, or a queue item
does once per KV head.

The same code twice: inlined in the grid's kernel (as before the queue), and as a call in
the queue's loop (`attend_tile_call`), where inlined its invariants were hoisted across the
items and spilled at sm_90 (triton 3.9 offline compile: 255 registers, 72-168 bytes).
"""

from __future__ import annotations

from embodied_kv.kernels.triton_base import tl, triton

if triton is not None:
    from embodied_kv.kernels.expert_combine import tile_rows
    from embodied_kv.kernels.rope import rotated_rows
    from embodied_kv.kernels.triton_base import attend_block, load_kv_block

    @triton.jit
    def rotate_keys(
        ks_at, kr_at, cos_ptr, sin_ptr, stride_cn, stride_kst, stride_krt, h_len,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_BF16: tl.constexpr,
    ):  # fmt: skip
        """The H suffix keys of a KV head at `ks_at`, rotated (kernels/rope.py's bytes) into
        the contiguous [H, D] scratch at `kr_at`; stored before any thread reads them back."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)  # a power of two (rope_on_load)
        for block in range(0, h_len, BLOCK_N):
            rows = block + offs_n
            live_k = (rows < h_len)[:, None]  # [BLOCK_N, 1]
            k = rotated_rows(ks_at + rows[:, None] * stride_kst, rows[:, None] * stride_cn,
                             live_k, cos_ptr, sin_ptr, HEAD_DIM // 2, ROUND_BF16)  # fmt: skip
            tl.store(kr_at + rows[:, None] * stride_krt + offs_d[None, :], k, mask=live_k)
        tl.debug_barrier()

    def attend_tile_fn(
        tile_m, kv_head, split, q_ptr, kp_ptr, vp_ptr, ks_ptr, vs_ptr, bias_ptr, m_ptr, l_ptr,
        acc_ptr, cos_ptr, sin_ptr, stride_cn, kr_ptr, kr_row, stride_krt, h_len, n_prefix,
        chunk, qk_scale, n_heads, stride_qn, stride_qh, stride_kpt, stride_kph, stride_vpt,
        stride_vph, stride_kst, stride_ksh, stride_vst, stride_vsh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLIT_P: tl.constexpr, DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, ROPE: tl.constexpr, ROTATE_KEYS: tl.constexpr,
        ROUND_BF16: tl.constexpr,
    ):  # fmt: skip
        """One program's work: split `split` of tile (tile_m, kv_head) -> its partial (max,
        sum, unnormalised output) in the workspace. Split j < NUM_SPLITS - 1 reads prefix rows
        [j * chunk, (j + 1) * chunk), the last split the H suffix rows. ROPE: q is rotated as
        it is loaded, and the suffix keys are read rotated from an [H, D] scratch at `kr_ptr`:
        the tile's, which the suffix split fills first (ROTATE_KEYS), else row `kr_row`, which
        a queue item has filled. Its address is formed where it is used (computed before,
        it stays live throughout: spills at sm_90)."""
        kv_head = kv_head.to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        tok, heads, live_r = tile_rows(tile_m, kv_head, h_len, GROUP, GROUP_PAD, BLOCK_M)
        mask_d = offs_d < HEAD_DIM
        q_at = q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh
        # padded rows see q = 0: finite scores, no NaN
        if ROPE:  # as kernels/rope.py would have stored them: the same bytes
            q = rotated_rows(q_at, tok[:, None] * stride_cn, live_r[:, None], cos_ptr, sin_ptr,
                             HEAD_DIM // 2, ROUND_BF16)  # fmt: skip
            if ROTATE_KEYS:
                if split == NUM_SPLITS - 1:  # before the softmax state is live (rotating
                    # the keys inside the loop spilled at sm_90; before q, 8 bytes)
                    tile = tile_m * (n_heads // GROUP) + kv_head  # this tile's scratch
                    rotate_keys(ks_ptr + kv_head * stride_ksh,
                                 kr_ptr + tile.to(tl.int64) * h_len * stride_krt, cos_ptr,
                                 sin_ptr, stride_cn, stride_kst, stride_krt, h_len, HEAD_DIM,
                                 BLOCK_N,
                                 ROUND_BF16)  # fmt: skip
        else:
            q = tl.load(q_at + offs_d[None, :], mask=live_r[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
        if split < NUM_SPLITS - 1:  # a chunk of the prefix; it may hold no admitted row
            kp_base = kp_ptr + kv_head * stride_kph
            vp_base = vp_ptr + kv_head * stride_vph
            start = split * chunk
            end = tl.minimum(start + chunk, n_prefix)
            for block in range(start, end, BLOCK_N):
                rows = block + offs_n
                b = tl.load(bias_ptr + rows, mask=rows < end, other=float("-inf"))
                # masked rows are not even loaded: whatever a bucket's tail holds (stale rows
                # of a language request, NaN) stays out of both products
                admitted = b == 0.0  # [BLOCK_N]
                k = tl.load(
                    kp_base + rows[None, :] * stride_kpt + offs_d[:, None],
                    mask=admitted[None, :] & mask_d[:, None],
                    other=0.0,
                )  # [BLOCK_D, BLOCK_N]
                v = tl.load(
                    vp_base + rows[:, None] * stride_vpt + offs_d[None, :],
                    mask=admitted[:, None] & mask_d[None, :],
                    other=0.0,
                )  # [BLOCK_N, BLOCK_D]
                m_i, l_i, acc = attend_block(
                    q, k, v, admitted[None, :], m_i, l_i, acc, qk_scale,
                    SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
        else:  # the suffix, bidirectional: every row sees H >= 1 keys, so m_i is finite
            ks_base = ks_ptr + kv_head * stride_ksh
            if ROPE:  # the rotated keys
                if ROTATE_KEYS:
                    tile = tile_m * (n_heads // GROUP) + kv_head
                    ks_base = kr_ptr + tile.to(tl.int64) * h_len * stride_krt
                else:
                    ks_base = kr_ptr + kr_row.to(tl.int64) * h_len * stride_krt
                stride_kst = stride_krt
            vs_base = vs_ptr + kv_head * stride_vsh
            for block in range(0, h_len, BLOCK_N):
                rows = block + offs_n
                k, v = load_kv_block(
                    ks_base, vs_base, rows, h_len, offs_d, mask_d, stride_kst, stride_vst
                )
                valid = (rows < h_len)[None, :]
                m_i, l_i, acc = attend_block(
                    q, k, v, valid, m_i, l_i, acc, qk_scale,
                    SPLIT_P, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
        part = (tok * n_heads + heads) * NUM_SPLITS + split  # [ROWS] rows of the workspace
        tl.store(m_ptr + part, m_i, mask=live_r)
        tl.store(l_ptr + part, l_i, mask=live_r)
        tl.store(
            acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=live_r[:, None] & mask_d[None, :],
        )

    # inlined in the grid's kernel (its code as before the queue); a call in the queue's
    # loop, where inlined its invariants were hoisted across the items and spilled at sm_90
    attend_tile = triton.jit(attend_tile_fn)
    attend_tile_call = triton.jit(noinline=True)(attend_tile_fn)
