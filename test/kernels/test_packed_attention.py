"""Packed attention: the torch reference vs a naive loop, and the Triton dispatcher.

The kernels themselves are tested against the reference in test_decode_splitk.py and
test_prefill_tile.py; here, what the entry point adds: the kernel choice (no host sync, fixed
per step shape), static `out` buffers, strided views and input validation."""

import pytest
import torch

import embodied_kv.kernels.decode_splitk as ds
import embodied_kv.kernels.packed_attention as pa
import embodied_kv.kernels.prefill_tile as pt

# Each case is a list of (slot, kv_len) per token, in packing order.
CASES = {
    "single": [(0, 1)],
    "prefill": [(2, n) for n in range(60, 68)],  # one slot, causal: kv_len grows by one
    "decode": [(3, 1), (0, 7), (4, 63), (1, 65), (2, 130)],  # one token per slot, slots shuffled
    "mixed": [(1, 7), (4, 62), (4, 63), (4, 64), (4, 65), (0, 130), (3, 1), (1, 8)],
    "prefix": [(2, 65)] * 3 + [(0, 7)] * 2,  # bidirectional prefix: equal kv_len in a run
}
_gen = torch.Generator().manual_seed(1)
CASES["scattered"] = list(  # every slot, random lengths, same-slot tokens not adjacent
    zip(
        torch.randint(0, 5, (24,), generator=_gen).tolist(),
        torch.randint(1, 137, (24,), generator=_gen).tolist(),
        strict=True,
    )
)
REF_HEADS = {"mqa": (4, 1, 32), "gqa": (6, 2, 16)}


def naive_attention(q, k_cache, v_cache, slot, kv_len, scale):
    """One token at a time: gather its slot's rows, repeat kv heads, softmax. fp32 out."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        n = int(kv_len[i])
        k = k_cache[slot[i], :n].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[slot[i], :n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(REF_HEADS))
def test_reference_matches_naive_loop(make_inputs, fp32_close, case, heads):
    args = make_inputs(CASES[case], REF_HEADS[heads])
    fp32_close(pa.packed_attention_ref(*args), naive_attention(*args))


@pytest.mark.parametrize("case", ["mixed", "scattered"])
@pytest.mark.parametrize("heads", list(REF_HEADS))
def test_reference_is_batch_invariant(make_inputs, case, heads):
    """A token's output is the same bytes alone as packed with other slots' tokens."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES[case], REF_HEADS[heads])
    packed = pa.packed_attention_ref(q, k, v, slot, kv_len, scale)
    for i in range(len(slot)):
        one = slice(i, i + 1)
        alone = pa.packed_attention_ref(q[one], k, v, slot[one], kv_len[one], scale)
        assert torch.equal(packed[one], alone), f"token {i}"


@pytest.mark.parametrize("case", ["decode", "mixed", "scattered"])
def test_one_plan_serves_every_layer_with_the_same_lengths(make_inputs, case):
    """`plan_ref` made once (what the backbone does per step) and passed to calls over other
    layers' K/V gives each call the bytes it computes when it plans for itself."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES[case], REF_HEADS["mqa"])
    runs = pa.contiguous_runs(slot)
    plan = pa.plan_ref(runs, kv_len, kv_len.cpu(), q.shape[1] // k.shape[2], k.shape[1])
    for layer in range(3):  # other K/V and queries, as in the next layers
        g = torch.Generator().manual_seed(layer)
        k2, v2 = (torch.randn(k.shape, generator=g).to(k) for _ in range(2))
        q2 = torch.randn(q.shape, generator=g).to(q)
        planned = pa.packed_attention_ref(q2, k2, v2, slot, kv_len, scale, plan=plan)
        assert torch.equal(planned, pa.packed_attention_ref(q2, k2, v2, slot, kv_len, scale))


def test_entry_point_writes_out_buffer(make_inputs):
    """`packed_attention(out=...)` fills the caller's buffer on every path (CPU: reference)."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES["mixed"], REF_HEADS["gqa"])
    out = torch.full_like(q, float("nan"))
    assert pa.packed_attention(q, k, v, slot, kv_len, scale, out=out) is out
    assert torch.equal(out, pa.packed_attention(q, k, v, slot, kv_len, scale))


def _plan(n_tok, decode=None):
    """Launches planned on meta tensors at pi05 heads. Meta tensors hold no values, so a plan
    that read one on the host (a device sync, fatal in graph capture) would raise here."""
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    q = torch.empty(n_tok, 8, 256, **meta)
    k = torch.empty(3, 1024, 1, 256, **meta)
    idx = torch.empty(n_tok, dtype=torch.int64, device="meta")
    return pa.plan_kernel(q, k, k, idx, idx, 256**-0.5, torch.empty_like(q), decode)


def test_dispatcher_picks_by_step_size_or_hint():
    """Default: split-K (partial + reduce) up to SPLITK_MAX_TOKENS tokens, the tile above;
    an explicit hint overrides either way."""
    kernels = lambda launches: [launch.name.split()[0] for launch in launches]  # noqa: E731
    assert kernels(_plan(pa.SPLITK_MAX_TOKENS)) == ["splitk_partial", "splitk_reduce"]
    tile = ["prefill_tile"] + (["prefill_reduce"] if pt.KEY_SPLITS > 1 else [])
    assert kernels(_plan(pa.SPLITK_MAX_TOKENS + 16)) == tile
    assert kernels(_plan(16, decode=False)) == tile
    assert kernels(_plan(1024, decode=True)) == ["splitk_partial", "splitk_reduce"]
    partial, reduce = _plan(16)
    assert partial.grid == (16, 1, 16) and reduce.grid == (16, 8)  # T = 1024: 16 splits
    tokens = pt.tile_config(torch.bfloat16, 8, pt.KEY_SPLITS).block_m  # 8 × 8 heads unsplit
    assert _plan(64)[0].grid == (64 // tokens, 1, pt.KEY_SPLITS)


@pytest.mark.parametrize("decode", [True, False])
def test_kernels_ignore_rows_past_kv_len_and_are_batch_invariant(kernel, make_inputs, decode):
    """Both kernels: NaN past every slot's valid rows changes nothing, and a token alone gives
    the bytes it gives packed with other slots' tokens (in one tile, for the tile kernel)."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES["mixed"], REF_HEADS["gqa"])
    out = pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, decode=decode)
    dirty_k, dirty_v = k.clone(), v.clone()
    for s in slot.unique().tolist():
        n = int(kv_len[slot == s].max())
        dirty_k[s, n:] = float("nan")
        dirty_v[s, n:] = float("nan")
    dirty = pa.packed_attention_kernel(q, dirty_k, dirty_v, slot, kv_len, scale, decode=decode)
    assert torch.equal(dirty, out)
    for i in (3, 6):
        one = slice(i, i + 1)
        alone = pa.packed_attention_kernel(
            q[one], k, v, slot[one], kv_len[one], scale, decode=decode
        )
        assert torch.equal(alone, out[one]), f"token {i}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("decode", [True, False])
def test_kernels_replay_in_a_cuda_graph(make_inputs, decode):
    """Captured once over static slot / kv_len / out / workspace, replayed with other slots
    and lengths: the bytes of an eager call on the new inputs."""
    q, k, v, slot, kv_len, scale = make_inputs(CASES["mixed"], (8, 1, 256), torch.bfloat16)
    out = torch.empty_like(q)
    splits = ds.splitk_config(q.dtype, k.shape[1]).num_splits
    work = ds.workspace(q.shape[0], 8, 256, splits, q.device)
    slot_s, len_s = slot.clone(), kv_len.clone()

    def run():
        pa.packed_attention_kernel(
            q, k, v, slot_s, len_s, scale, decode=decode, out=out, workspace=work
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_slot, new_len = slot.flip(0), (kv_len * 7) % k.shape[1] + 1
    slot_s.copy_(new_slot)
    len_s.copy_(new_len)
    graph.replay()
    torch.cuda.synchronize()
    expected = pa.packed_attention_kernel(q, k, v, new_slot, new_len, scale, decode=decode)
    assert torch.equal(out, expected)


def test_kernel_writes_out_buffer(kernel, make_inputs):
    q, k, v, slot, kv_len, scale = make_inputs(CASES["decode"], REF_HEADS["mqa"], torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    assert pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, out=out) is out
    assert torch.equal(out, pa.packed_attention_kernel(q, k, v, slot, kv_len, scale))


@pytest.mark.parametrize("decode", [True, False])
def test_kernel_strided_inputs(kernel, make_inputs, fp32_close, decode):
    """Views with padded head and row strides, as layer slices of a larger arena give."""
    hq, hkv, d = REF_HEADS["gqa"]
    q, k, v, slot, kv_len, scale = make_inputs(CASES["mixed"], (hq, hkv, d))
    q_wide = torch.zeros(q.shape[0], hq, d + 8, device=q.device)
    q_wide[..., :d] = q
    kv = torch.zeros(2, *k.shape[:3], d + 3, device=q.device)  # [K|V, S, T, Hkv, D+3]
    kv[0, ..., :d], kv[1, ..., :d] = k, v
    out_wide = torch.zeros_like(q_wide)
    args = (q_wide[..., :d], kv[0, ..., :d], kv[1, ..., :d], slot, kv_len, scale)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    pa.packed_attention_kernel(*args, decode=decode, out=out_wide[..., :d])
    fp32_close(out_wide[..., :d], pa.packed_attention_ref(q, k, v, slot, kv_len, scale))
    assert not out_wide[..., d:].any(), "wrote outside the out view"


def test_kernel_rejects_bad_inputs(kernel, make_inputs):
    q, k, v, slot, kv_len, scale = make_inputs(CASES["single"], REF_HEADS["mqa"])
    with pytest.raises(ValueError, match="dtypes differ"):
        pa.packed_attention_kernel(q, k.half(), v, slot, kv_len, scale)
    with pytest.raises(ValueError, match="integer"):
        pa.packed_attention_kernel(q, k, v, slot.float(), kv_len, scale)
    with pytest.raises(ValueError, match="out"):
        pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, out=q[:, :2])
    with pytest.raises(ValueError, match="out dtype"):
        pa.packed_attention_kernel(q, k, v, slot, kv_len, scale, out=q.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        pa.packed_attention_kernel(q[..., ::2], k[..., ::2], v[..., ::2], slot, kv_len, scale)
    big = torch.zeros(1, 1, 1, 512, device=q.device)
    with pytest.raises(RuntimeError, match="head_dim"):
        pa.packed_attention_kernel(q.new_zeros(1, 1, 512), big, big, slot, kv_len, scale)
