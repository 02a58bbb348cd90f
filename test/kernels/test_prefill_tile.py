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


def split_tile(q, k, v, slot, kv_len, scale, splits):
    """The tile with `splits` programs over each token's keys (fp32 inputs: no cast)."""
    out = torch.empty_like(q)
    for launch in pt.plan_tile(q, k, v, slot, kv_len, scale, out, splits):
        launch.run()
    return out


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("case", ["prefill", "mixed", "scattered"])
def test_key_splits_match_the_reference_and_stay_batch_invariant(kernel, make_inputs, fp32_close,
                                                                 case, splits):  # fmt: skip
    """Each token's keys in `splits` block-aligned chunks of its own kv_len (then the reduce):
    the reference's result, NaN past every slot's rows ignored, and a token's bytes do not
    change when the other tokens of its tile change their slots, lengths and queries (the
    chunks never depend on them; the token keeps its row of the tile, since the interpreter's
    products round rows of a tile differently)."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES[case], (8, 1, 64))
    out = split_tile(q, k, v, slot, kv_len, scale, splits)
    fp32_close(out, pa.packed_attention_ref(q, k, v, slot, kv_len, scale))
    dirty_k, dirty_v = k.clone(), v.clone()
    for s in slot.unique().tolist():
        n = int(kv_len[slot == s].max())
        dirty_k[s, n:], dirty_v[s, n:] = float("nan"), float("nan")
    assert torch.equal(split_tile(q, dirty_k, dirty_v, slot, kv_len, scale, splits), out)
    g = torch.Generator().manual_seed(splits)
    for i in (1, len(slot) - 2):
        others = torch.arange(len(slot)) != i
        q2, slot2, len2 = q.clone(), slot.clone(), kv_len.clone()
        q2[others] = torch.randn(q2[others].shape, generator=g)
        slot2[others] = torch.randint(0, k.shape[0], (int(others.sum()),), generator=g)
        len2[others] = torch.randint(1, k.shape[1] + 1, (int(others.sum()),), generator=g)
        moved = split_tile(q2, k, v, slot2, len2, scale, splits)
        assert torch.equal(moved[i], out[i]), f"token {i}"


def test_key_splits_are_one_or_a_power_of_two():
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    q, k = torch.empty(64, 8, 256, **meta), torch.empty(3, 1024, 1, 256, **meta)
    idx = torch.empty(64, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="key_splits"):
        pt.plan_tile(q, k, k, idx, idx, 0.0625, q, 3)
    assert [x.name.split()[0] for x in pt.plan_tile(q, k, k, idx, idx, 0.0625, q, 1)] == [
        "prefill_tile"
    ]
