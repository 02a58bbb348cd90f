"""Prefill tile kernel (kernels/prefill_tile.py) vs `packed_attention_ref`, interpreter on CPU.

Every kernel call goes through the validated entry with decode=False (the tile path). Tiles
hold 4-64 tokens (BLOCK_M = TILE_ROWS / GROUP_PAD), so the cases put run boundaries, decode
tokens and shuffled slots inside one tile, and runs that end mid-tile."""

import pytest
import torch

import embodied_kv.kernels.packed_attention as pa
import embodied_kv.kernels.prefill_tile as pt

# (slot, kv_len) per token in packing order; MAX_LEN = 136 rows per slot (conftest).
CASES = {
    "prefill": [(2, n) for n in range(100, 137)],  # causal, 37 tokens: ends mid-tile
    "prefix": [(2, 65)] * 19 + [(0, 7)] * 2,  # bidirectional: equal kv_len within a run
    # ActionFlow-style: a causal run, then decode tokens of other slots in the same tile
    "mixed": [(1, 7), (4, 62), (4, 63), (4, 64), (4, 65), (0, 130), (3, 1), (1, 8)],
    # every slot, lengths all over [1, 136], same-slot tokens never adjacent
    "scattered": [(i * 3 % 5, i * 37 % 136 + 1) for i in range(20)],
}


def tile(q, k, v, slot, kv_len, scale, **kw):
    return pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, decode=False, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_tile_matches_reference_fp32(kernel, make_inputs, fp32_close, heads, case):
    args = make_inputs(CASES[case], heads)
    fp32_close(tile(*args), pa.packed_attention_ref(*args))


@pytest.mark.parametrize(
    "case,heads,dtype",
    [
        ("prefill", (8, 1, 256), torch.bfloat16),
        ("mixed", (8, 1, 256), torch.bfloat16),
        ("scattered", (4, 2, 48), torch.float16),
    ],
)
def test_tile_low_precision(kernel, make_inputs, low_precision_close, case, heads, dtype):
    args = make_inputs(CASES[case], heads, dtype)
    low_precision_close(tile, pa.packed_attention_ref, *args)


def test_tile_config_rows():
    """At pi05 a tile is 8 tokens × 8 heads; every group keeps >= 16 rows for tl.dot."""
    cfg = pt.tile_config(torch.bfloat16, 8)
    assert (cfg.block_m, cfg.group_pad) == (8, 8)
    for dtype in (torch.float32, torch.bfloat16):
        for group in range(1, 33):
            cfg = pt.tile_config(dtype, group)
            assert cfg.group_pad >= group and cfg.block_m * cfg.group_pad >= 16
