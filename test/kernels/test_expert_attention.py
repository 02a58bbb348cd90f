"""Expert attention kernel (kernels/expert_attention.py) vs `expert_attention_ref`,
interpreter on CPU: suffix lengths that end mid-tile, prefixes masked past their length
(a graph's row bucket), prefix rows read in place from a strided arena slot."""

import pytest
import torch

from embodied_kv.kernels import work_queue
from embodied_kv.kernels.decode_splitk import MAX_SPLITS
from embodied_kv.kernels.expert_attention import (
    REDUCES,
    chunk_blocks,
    expert_attention_kernel,
    expert_attention_ref,
    expert_workspace,
    plan_expert_attention,
    split_count,
)
from embodied_kv.kernels.prefill_tile import tile_config
from embodied_kv.kernels.rope import rope_kernel, rope_pair
from embodied_kv.model.layers import Rope
from embodied_kv.model.vla import DENOISE_BUCKETS

from .conftest import DEVICE, FP32_TOL, HEADS, LOW_PRECISION_FACTOR

# (suffix tokens H, prefix rows read P, prefix length <= P): exact prefix, masked bucket;
# the prefix is split over programs (split_count): many splits, splits holding only masked
# rows (a short prefix in a long bucket), and the MAX_SPLITS cap (chunks of several blocks)
CASES = {
    "exact": (10, 37, 37),
    "bucket": (13, 64, 41),
    "one_row": (3, 16, 1),
    "many_splits": (9, 300, 300),
    "masked_splits": (5, 320, 41),
    "capped": (2, 2100, 1999),
    "pi05_bucket": (7, 704, 663),  # a 2-camera pi05 prefix in its 64-row bucket: a short
    # last chunk (15 chunks of 48 rows over 704)
}


def inputs(case, heads, dtype=torch.float32, seed=0):
    h_len, n_rows, plen = CASES[case]
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    arena_k = torch.randn(3, n_rows + 5, hkv, d, generator=g)  # [S, T, Hkv, D]
    arena_v = torch.randn(3, n_rows + 5, hkv, d, generator=g)
    arena_k[1, plen:] = float("nan")  # rows past the prefix: masked, never let through
    arena_v[1, plen:] = float("nan")
    q = torch.randn(h_len, hq, d, generator=g)
    ks, vs = torch.randn(2, h_len, hkv, d, generator=g)
    bias = torch.zeros(n_rows + h_len)
    bias[plen:n_rows] = float("-inf")
    to = {"dtype": dtype, "device": DEVICE}
    kp, vp = arena_k.to(**to)[1, :n_rows], arena_v.to(**to)[1, :n_rows]  # views
    return q.to(**to), kp, vp, ks.to(**to), vs.to(**to), d**-0.5, bias.to(DEVICE)


def finite_ref(q, kp, vp, ks, vs, scale, bias):
    """The reference with masked rows zeroed (a -inf score times a NaN value is NaN in the
    torch reference; the kernel never loads a masked row into a product that counts)."""
    keep = (bias[: kp.shape[0]] == 0)[:, None, None]
    zero = torch.zeros((), dtype=kp.dtype, device=kp.device)
    kp, vp = torch.where(keep, kp, zero), torch.where(keep, vp, zero)
    return expert_attention_ref(q, kp, vp, ks, vs, scale, bias)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", ["mqa4", "gqa3", "pi05"])
def test_kernel_matches_reference_fp32(kernel, case, heads):
    args = inputs(case, HEADS[heads])
    out = expert_attention_kernel(*args)
    assert out.shape == args[0].shape and torch.isfinite(out).all()
    torch.testing.assert_close(out, finite_ref(*args), atol=FP32_TOL, rtol=FP32_TOL)


def test_split_counts_cover_the_cases():
    """The cases above exercise 2 splits, several, and the cap."""
    block_n = tile_config(torch.float32, 8).block_n
    counts = {c: split_count(CASES[c][1], block_n) for c in CASES}
    assert counts["exact"] == 2 and 4 <= counts["many_splits"] < MAX_SPLITS
    assert counts["capped"] == MAX_SPLITS and counts["masked_splits"] >= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_denoise_bucket_is_covered_by_its_splits(dtype):
    """The row buckets the denoise graphs use (model/vla.py): the prefix chunks cover
    every row, none starts past the bucket, and the splits stay within the reduce's cap."""
    block_n = tile_config(dtype, 8).block_n
    for rows in DENOISE_BUCKETS:
        splits = split_count(rows, block_n)
        chunk = chunk_blocks(rows, block_n, splits) * block_n
        assert 2 <= splits <= MAX_SPLITS
        assert (splits - 1) * chunk >= rows, (rows, splits, chunk)
    assert split_count(704, block_n) < split_count(1024, block_n)  # fewer partials


@pytest.mark.parametrize("case", ["exact", "bucket", "masked_splits", "pi05_bucket"])
def test_kernel_low_precision(kernel, case):
    q, kp, vp, ks, vs, scale, bias = inputs(case, HEADS["pi05"], torch.bfloat16, seed=1)
    exact = finite_ref(q.float(), kp.float(), vp.float(), ks.float(), vs.float(), scale, bias)
    ref_err = (finite_ref(q, kp, vp, ks, vs, scale, bias).float() - exact).abs().max()
    out = expert_attention_kernel(q, kp, vp, ks, vs, scale, bias)
    assert out.dtype == torch.bfloat16
    err = (out.float() - exact).abs().max()
    assert err <= LOW_PRECISION_FACTOR * ref_err, f"kernel {err:.3g} vs reference {ref_err:.3g}"


def test_bad_inputs_are_refused(kernel):
    q, kp, vp, ks, vs, scale, bias = inputs("exact", HEADS["mqa4"])
    with pytest.raises(ValueError, match="bias"):
        expert_attention_kernel(q, kp, vp, ks, vs, scale, bias[:-1])
    with pytest.raises(ValueError, match="ks"):
        expert_attention_kernel(q, kp, vp, ks[:-1], vs, scale, bias)


def _work(q, kp):
    (h_len, hq, d), (n_p, hkv) = q.shape, kp.shape[:2]
    return expert_workspace(h_len, hq, hkv, d, n_p, q.dtype, q.device)


@pytest.mark.parametrize("reduce", ["last", "queue"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("case", "heads"), [("bucket", "gqa3"), ("masked_splits", "pi05")])
def test_one_launch_reduces_match_two_kernels_bytewise(kernel, reduce, dtype, case, heads):
    """One kernel = partials + separate reduce, byte for byte under the interpreter: the last
    split of a tile reduces ("last"), or the persistent queue's reduce items do ("queue"); run
    twice on one workspace: same bytes, every counter (and the queue) back at 0, no wait
    timed out. (On a GPU the reduce kernel's tree order differs by a few fp32 ulps.)
    masked_splits holds splits with no admitted row; gqa3 two KV heads."""
    args = inputs(case, HEADS[heads], dtype, seed=2)
    work = _work(args[0], args[1])
    one = expert_attention_kernel(*args, work=work, reduce=reduce)
    assert int(work[3].abs().sum()) == 0 and work[3].numel() > 2
    again = expert_attention_kernel(*args, work=work, reduce=reduce)
    two = expert_attention_kernel(*args, reduce="launch")
    assert torch.equal(one, again)
    if DEVICE == "cpu":
        assert torch.equal(one, two)
    else:  # the reduce kernel sums the splits as a tree: a few fp32 ulps, one of the dtype
        ulp = 2e-6 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(one, two, atol=ulp, rtol=ulp)
    assert int(work[3].abs().sum()) == 0
    exact = finite_ref(*(a.float() if torch.is_tensor(a) else a for a in args[:6]), args[6])
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(one.float(), exact, atol=tol, rtol=tol)


def test_the_queue_is_one_persistent_launch_and_the_default():
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    q, kv = torch.empty(50, 8, 256, **meta), torch.empty(1024, 1, 256, **meta)
    bias = torch.empty(1074, device="meta")
    args = (q, kv, kv, q[:, :1], q[:, :1], 0.0625, bias, q, None)
    plans = {r: plan_expert_attention(*args, r) for r in REDUCES}
    assert [x.name.split()[0] for x in plans["last"]] == ["expert_attention_fused"]
    assert [x.name.split()[0] for x in plans["launch"]] == ["expert_attention", "expert_reduce"]
    (queue,) = plans["queue"]
    # 7 tiles x 16 splits partials + 7 x 8 reduce items, on a persistent grid (meta: CPU's)
    assert queue.name.split()[0] == "expert_attention_queue"
    assert queue.grid == (work_queue.programs(7 * 16 + 7 * 8, "cpu"),)
    assert [x.name for x in plan_expert_attention(*args)] == [queue.name]
    with pytest.raises(ValueError, match="reduce"):
        plan_expert_attention(*args, "fused")


def test_a_wait_that_cannot_be_met_flags_an_error_and_returns(kernel):
    """The queue's waits are bounded: arrivals that never come (a tile's counter started
    below zero, as a bug could leave it) end in the error flag after max_spins polls, not in
    a hang; the flag stays for the caller (work_queue.failed) until it clears it."""
    args = inputs("bucket", HEADS["gqa3"], seed=5)
    work = _work(args[0], args[1])
    work[3][0] = -1
    expert_attention_kernel(*args, work=work, reduce="queue", max_spins=3)
    assert work_queue.failed(work[3][-2:])
    work[3].zero_()
    expert_attention_kernel(*args, work=work, reduce="queue", max_spins=3)
    assert not work_queue.failed(work[3][-2:])


def test_workspace_of_another_shape_is_refused(kernel):
    a = inputs("exact", HEADS["mqa4"])
    b = inputs("bucket", HEADS["mqa4"])
    work = _work(a[0], a[1])
    expert_attention_kernel(*a, work=work)
    with pytest.raises(ValueError, match="work"):
        expert_attention_kernel(*b, work=work)
    out = expert_attention_kernel(*b, work=_work(b[0], b[1]))  # its own: fine
    torch.testing.assert_close(out, finite_ref(*b), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("case", "heads"), [("bucket", "gqa3"), ("pi05_bucket", "pi05"), ("exact", "mha")]
)
def test_rope_on_load_is_the_rope_kernel_then_the_attention_bytewise(kernel, dtype, case, heads):
    """The chain hands q and the suffix k over unrotated, as adjacent heads of the fused
    q/k/v output, with the suffix's RoPE tables: the kernel rotates them as it loads them
    (each of its reduce forms), the same bytes as kernels/rope.py's rotation stored first
    (irregular positions; the suffix ends mid-tile). The dispatcher's reference path
    (rope_pair, then the reference) agrees within the low-precision tolerance."""
    q, kp, vp, ks, vs, scale, bias = inputs(case, HEADS[heads], dtype, seed=3)
    h_len, hq, d = q.shape
    hkv = kp.shape[1]
    qkv = torch.cat([q, ks, vs], dim=1)  # [H, Hq + 2 Hkv, D]: the fused GEMM's layout
    q, ks, vs = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    rope = Rope(d, 2048, 10000.0).to(DEVICE)
    rope.reset_tables()
    positions = torch.randint(0, 2048, (h_len,), generator=torch.Generator().manual_seed(4))
    cos, sin = rope.at(positions.to(DEVICE))
    rq, rk = rope_kernel(q, cos, sin), rope_kernel(ks, cos, sin)
    for reduce in REDUCES:  # each tile's suffix split rotates the keys, or a queue item does
        want = expert_attention_kernel(rq, kp, vp, rk, vs, scale, bias, reduce=reduce)
        got = expert_attention_kernel(q, kp, vp, ks, vs, scale, bias, reduce=reduce,
                                      rope=(cos, sin))  # fmt: skip
        assert torch.equal(got, want), reduce
    rq, rk = rope_pair(q, ks, cos, sin)  # on a CPU: rope_ref, the chain's bytes
    ref = finite_ref(*(t.float() for t in (rq, kp, vp, rk, vs)), scale, bias)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_rope_tables_of_another_shape_are_refused(kernel):
    q, kp, vp, ks, vs, scale, bias = inputs("exact", HEADS["mqa4"])
    cos = torch.zeros(q.shape[0] + 1, 1, q.shape[2], device=DEVICE)
    with pytest.raises(ValueError, match="rope: cos"):
        expert_attention_kernel(q, kp, vp, ks, vs, scale, bias, rope=(cos, cos))


def test_rope_on_load_takes_power_of_two_head_dims_only(kernel):
    """gqa2's head_dim 48: the kernel refuses to rotate; the dispatcher's path rotates first."""
    q, kp, vp, ks, vs, scale, bias = inputs("exact", HEADS["gqa2"])
    cos = torch.zeros(q.shape[0], 1, q.shape[2], device=DEVICE)
    with pytest.raises(RuntimeError, match="power of two"):
        expert_attention_kernel(q, kp, vp, ks, vs, scale, bias, rope=(cos, cos))
