"""Split-K decode kernel (kernels/decode_splitk.py) vs `packed_attention_ref`, interpreter on CPU.

Every kernel call goes through the validated entry with decode=True (the split-K path)."""

import pytest
import torch

import embodied_kv.kernels.decode_splitk as ds
import embodied_kv.kernels.packed_attention as pa

# (slot, kv_len) per token in packing order; MAX_LEN = 136 rows per slot (conftest).
CASES = {
    "decode": [(3, 1), (0, 7), (4, 63), (1, 65), (2, 136)],  # one token per slot, shuffled
    # a causal run, a bidirectional run (equal kv_len), decode tokens, a slot seen twice
    "mixed": [(1, 7), (4, 62), (4, 63), (4, 64), (0, 130), (0, 130), (3, 1), (1, 8)],
}


def splitk(q, k, v, slot, kv_len, scale, **kw):
    return pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, decode=True, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_splitk_matches_reference_fp32(kernel, make_inputs, fp32_close, heads, case):
    args = make_inputs(CASES[case], heads)
    fp32_close(splitk(*args), pa.packed_attention_ref(*args))


@pytest.mark.parametrize("num_splits", [2, 32])
def test_splitk_empty_splits_and_stale_workspace(kernel, make_inputs, fp32_close, num_splits):
    """32 splits of a 1-row slot: 31 empty splits. 2 splits of 136 rows: uneven chunks.
    The workspace starts as NaN: nothing stale may leak into the result."""
    tokens = [(0, 1), (2, 31), (3, 33), (4, 64), (1, 135), (2, 136)]
    q, k, v, slot, kv_len, scale = make_inputs(tokens, (2, 1, 48))
    work = ds.workspace(len(tokens), 2, 48, num_splits, q.device)
    for buf in work:
        buf.fill_(float("nan"))
    out = splitk(q, k, v, slot, kv_len, scale, workspace=work, num_splits=num_splits)
    fp32_close(out, pa.packed_attention_ref(q, k, v, slot, kv_len, scale))
    assert torch.isinf(work[0][0, :, 1:]).all(), "1-row token: splits 1.. are empty (max -inf)"


@pytest.mark.parametrize(
    "case,heads,dtype",
    [
        ("decode", (8, 1, 256), torch.bfloat16),
        ("mixed", (8, 1, 256), torch.bfloat16),
        ("decode", (6, 2, 16), torch.float16),
    ],
)
def test_splitk_low_precision(kernel, make_inputs, low_precision_close, case, heads, dtype):
    args = make_inputs(CASES[case], heads, dtype)
    low_precision_close(splitk, pa.packed_attention_ref, *args)


def test_splitk_static_buffers_across_calls(kernel, make_inputs):
    """A graph replays one launch over fixed buffers with new slots and kv_len: the same
    `out` and workspace serve both steps and give the bytes of fresh buffers."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES["mixed"], (4, 1, 32))
    out = torch.empty_like(q)
    splits = ds.splitk_config(q.dtype, k.shape[1]).num_splits
    work = ds.workspace(q.shape[0], 4, 32, splits, q.device)
    assert splitk(q, k, v, slot, kv_len, scale, out=out, workspace=work) is out
    other_slot, other_len = slot.flip(0), (kv_len * 7) % 136 + 1
    splitk(q, k, v, other_slot, other_len, scale, out=out, workspace=work)
    assert torch.equal(out, splitk(q, k, v, other_slot, other_len, scale))


def test_splitk_rejects_bad_workspace(kernel, make_inputs):
    q, k, v, slot, kv_len, scale = make_inputs(CASES["decode"], (4, 1, 32))
    with pytest.raises(ValueError, match="num_splits"):
        splitk(q, k, v, slot, kv_len, scale, num_splits=3)
    with pytest.raises(ValueError, match="workspace"):
        splitk(q, k, v, slot, kv_len, scale, workspace=ds.workspace(4, 4, 32, 4, "cpu"))
