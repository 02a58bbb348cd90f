"""KEEP's segment sums (kv/selectors.py): the exact sums to fp32 rounding, the same bytes
whatever columns follow the segments (eager KEEP and the graph lay them out differently),
and the same bytes on every run (no atomics: `index_add_` on CUDA adds in a different
order each run, so the same request could choose different segments)."""

import pytest
import torch

from embodied_kv.kv.selectors import segment_bounds, segment_sums


def _case(seed: int, lengths: list[int], m: int = 6, tail: int = 0):
    g = torch.Generator().manual_seed(seed)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    owner = torch.cat([owner, torch.full((tail,), len(lengths))])  # not a segment's: after
    values = torch.rand(m, len(owner), generator=g).softmax(-1)  # attention-like, sum <= 1
    return values, owner


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [7], [4, 0, 0, 6, 2], [40] * 40])
def test_segment_sums_are_the_exact_sums_to_fp32_rounding(lengths):
    values, owner = _case(0, lengths, tail=3)
    bounds = segment_bounds(owner, len(lengths))
    out = segment_sums(values, bounds)
    ref = torch.zeros(values.shape[0], len(lengths), dtype=torch.float64)
    ref.index_add_(1, owner[owner < len(lengths)], values[:, owner < len(lengths)].double())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(out, ref.float())  # the fp64 sum rounded once: every byte
    assert torch.equal(out[:, torch.tensor(lengths) == 0], torch.zeros(6, lengths.count(0)))


def test_columns_after_the_segments_change_no_byte():
    """Eager KEEP sums over the prompt's segment tokens; the graph over its image rows,
    padded to a bucket: the columns past the last segment must not matter."""
    values, owner = _case(1, [12, 30, 7, 19])
    padded = torch.cat([values, torch.rand(values.shape[0], 50)], 1)
    owner_padded = torch.cat([owner, torch.full((50,), 4)])
    a = segment_sums(values, segment_bounds(owner, 4))
    b = segment_sums(padded, segment_bounds(owner_padded, 4))
    assert torch.equal(a, b)


def test_segment_columns_out_of_order_are_refused():
    with pytest.raises(ValueError, match="segment order"):
        segment_bounds(torch.tensor([0, 0, 2, 1, 1]), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="atomics are CUDA's")
def test_on_cuda_segment_sums_give_the_same_bytes_every_run_and_the_host_sums():
    values, owner = _case(2, [37] * 40, m=48, tail=21)
    bounds = segment_bounds(owner, 40)
    host = segment_sums(values, bounds)
    runs = {segment_sums(values.cuda(), bounds.cuda()).cpu().numpy().tobytes() for _ in range(50)}
    assert len(runs) == 1
    assert torch.allclose(segment_sums(values.cuda(), bounds.cuda()).cpu(), host, rtol=0, atol=1e-7)
