"""Attention-statistics kernel (kernels/attn_stats.py) vs `attn_stats_ref`, interpreter on CPU:
irregular query and key counts (not multiples of any block), every head configuration of the
packed-attention tests (MHA, GQA, MQA, pi05's 8:1 at D = 256), strided views of an arena."""

import pytest
import torch

from embodied_kv.kernels.attn_stats import attn_stats, attn_stats_kernel, attn_stats_ref

from .conftest import DEVICE, FP32_TOL

THRESHOLD = 0.01  # VL-Cache's p
# (τ query rows, m keys): one row, fewer rows than a block, a ragged second block, m of one key
SHAPES = [(1, 37), (5, 136), (17, 65), (33, 1)]


def inputs(rows, keys, heads, dtype=torch.float32, seed=0, spread=3.0):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, hq, d, generator=g) * spread
    k = torch.randn(keys, hkv, d, generator=g)
    return q.to(dtype).to(DEVICE), k.to(dtype).to(DEVICE), d**-0.5


@pytest.mark.parametrize("rows,keys", SHAPES)
def test_kernel_matches_reference_fp32(kernel, heads, rows, keys):
    q, k, scale = inputs(rows, keys, heads)
    col, below = attn_stats_kernel(q, k, scale, THRESHOLD)
    ref_col, ref_below = attn_stats_ref(q, k, scale, THRESHOLD)
    assert col.shape == (heads[0], keys) and below.shape == (heads[0],)
    assert below.dtype == torch.int64
    torch.testing.assert_close(col, ref_col, atol=FP32_TOL, rtol=FP32_TOL)
    # an entry within rounding of the threshold could count differently: none here
    assert torch.equal(below, ref_below), (below, ref_below)
    # every row's probabilities sum to one: the column sums add up to τ per head
    torch.testing.assert_close(col.sum(-1), torch.full((heads[0],), float(rows), device=col.device))


def test_kernel_reads_a_strided_arena_view(kernel):
    """k is arena.k[layer, slot, :m]: rows strided by Hkv * D, inside a larger tensor."""
    g = torch.Generator().manual_seed(3)
    arena = torch.randn(2, 4, 96, 2, 48, generator=g).to(DEVICE)  # [L, S, T, Hkv, D]
    q = torch.randn(20, 6, 48, generator=g).to(DEVICE)[:, :4]  # a head-strided view
    k = arena[1, 2, :70]
    col, below = attn_stats_kernel(q, k, 0.2, THRESHOLD)
    ref_col, ref_below = attn_stats_ref(q, k, 0.2, THRESHOLD)
    torch.testing.assert_close(col, ref_col, atol=FP32_TOL, rtol=FP32_TOL)
    assert torch.equal(below, ref_below)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision(kernel, dtype):
    """16-bit inputs, products exact in fp32: the column sums agree with the fp32 reference
    of the same rounded inputs up to summation order."""
    q, k, scale = inputs(21, 150, (8, 1, 256), dtype, seed=1, spread=1.0)
    col, below = attn_stats_kernel(q, k, scale, THRESHOLD)
    ref_col, ref_below = attn_stats_ref(q, k, scale, THRESHOLD)
    torch.testing.assert_close(col, ref_col, atol=1e-4, rtol=1e-4)
    assert (below - ref_below).abs().max() <= 1


def test_sparsity_counts_what_it_says():
    """A query aligned with one key: every other entry is far below 1% of the row max."""
    k = torch.eye(8).view(8, 1, 8) * 20
    q = k[:3].clone().view(3, 1, 8)
    col, below = attn_stats(q, k, 1.0, THRESHOLD)
    assert below.tolist() == [3 * 7]
    torch.testing.assert_close(col[0, :3], torch.ones(3), atol=1e-6, rtol=0)


def test_bad_inputs_are_refused():
    q, k, scale = inputs(3, 10, (4, 2, 16))
    with pytest.raises(ValueError, match="threshold"):
        attn_stats_ref(q, k, scale, 1.5)
    with pytest.raises(ValueError, match="multiple"):
        attn_stats_ref(q[:, :3], k, scale, THRESHOLD)
    with pytest.raises(ValueError, match="m=0"):
        attn_stats_ref(q, k[:0], scale, THRESHOLD)


@pytest.mark.parametrize("kernel_path", [False, True])
def test_workspace_path_reduces_to_the_reference(kernel, kernel_path):
    """What the prefill's recorder does (kv/compress.py): per layer, partials into a slice of
    one workspace (the kernel's blocks, or the reference's one row), reduced once."""
    from embodied_kv.kernels.attn_stats import attn_stats_into, stats_workspace

    layers = [inputs(37, 90, (4, 1, 32), seed=s) for s in range(3)]
    colsum, below = stats_workspace(37, 4, 90, DEVICE, len(layers), kernel=kernel_path)
    assert colsum.shape[1] == (3 if kernel_path else 1)
    for i, (q, k, scale) in enumerate(layers):
        attn_stats_into(q, k, scale, THRESHOLD, colsum[i], below[i])
    for i, (q, k, scale) in enumerate(layers):
        ref_col, ref_below = attn_stats_ref(q, k, scale, THRESHOLD)
        torch.testing.assert_close(colsum[i].sum(0), ref_col, atol=FP32_TOL, rtol=FP32_TOL)
        assert torch.equal(below[i].sum(0, dtype=torch.int64), ref_below)
