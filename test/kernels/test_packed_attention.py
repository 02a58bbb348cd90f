"""Packed attention: Triton kernel vs torch reference, and the reference vs a naive loop.

Without a GPU the kernel runs under the Triton interpreter on CPU tensors. Triton decorates
its own library (tl.zeros, ...) when first imported, so TRITON_INTERPRET must be set before
anything in the session imports triton: here, or in test/conftest.py for a whole-suite run.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import embodied_kv.kernels.packed_attention as pa  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel_skip_reason() -> str | None:
    if pa.triton is None:
        return "triton is not installed"
    stdlib_compiled = isinstance(pa.tl.zeros, pa.triton.runtime.JITFunction)
    if DEVICE == "cpu" and (stdlib_compiled or not pa.KERNEL_INTERPRETED):
        return (
            "no GPU, and triton was imported before TRITON_INTERPRET=1 was set: run "
            "test/kernels on its own or set the variable in test/conftest.py"
        )
    return None


needs_kernel = pytest.mark.skipif(
    _kernel_skip_reason() is not None, reason=str(_kernel_skip_reason())
)

FP32_TOL = 1e-5  # kernel and naive loop vs reference, fp32 (different summation orders)
LOW_PRECISION_FACTOR = 2.0  # kernel error <= this x the reference's own 16-bit error (STYLE)

HEADS = {"mqa": (4, 1, 32), "gqa": (6, 2, 16), "pi05": (8, 1, 256)}  # (Hq, Hkv, D)

# Each case is a list of (slot, kv_len) per token, in packing order.
CASES = {
    "single": [(0, 1)],
    "prefill": [(2, n) for n in range(60, 68)],  # one slot, causal: kv_len grows by one
    "decode": [(3, 1), (0, 7), (4, 63), (1, 65), (2, 130)],  # one token per slot, slots shuffled
    "mixed": [(1, 7), (4, 62), (4, 63), (4, 64), (4, 65), (0, 130), (3, 1), (1, 8)],
    "prefix": [(2, 65)] * 3 + [(0, 7)] * 2,  # bidirectional prefix: equal kv_len in a run
}
N_SLOTS, MAX_LEN = 5, 136
_gen = torch.Generator().manual_seed(1)
CASES["scattered"] = list(  # every slot, random lengths, same-slot tokens not adjacent
    zip(
        torch.randint(0, N_SLOTS, (24,), generator=_gen).tolist(),
        torch.randint(1, MAX_LEN + 1, (24,), generator=_gen).tolist(),
        strict=True,
    )
)


def make_inputs(case, heads, dtype=torch.float32, seed=0):
    """q [N, Hq, D], k/v [S, T, Hkv, D], slot [N], kv_len [N], scale."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    slot = torch.tensor([s for s, _ in CASES[case]], dtype=torch.int64)
    kv_len = torch.tensor([n for _, n in CASES[case]], dtype=torch.int64)
    q = torch.randn(len(slot), hq, d, generator=gen)
    k = torch.randn(N_SLOTS, MAX_LEN, hkv, d, generator=gen)
    v = torch.randn(N_SLOTS, MAX_LEN, hkv, d, generator=gen)
    to = {"dtype": dtype, "device": DEVICE}
    return q.to(**to), k.to(**to), v.to(**to), slot.to(DEVICE), kv_len.to(DEVICE), d**-0.5


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
@pytest.mark.parametrize("heads", ["mqa", "gqa"])
def test_reference_matches_naive_loop(case, heads):
    args = make_inputs(case, HEADS[heads])
    ref = pa.packed_attention_ref(*args)
    torch.testing.assert_close(ref, naive_attention(*args), atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("case", ["mixed", "scattered"])
@pytest.mark.parametrize("heads", ["mqa", "gqa"])
def test_reference_is_batch_invariant(case, heads):
    """A token's output is the same bytes alone as packed with other slots' tokens."""
    q, k, v, slot, kv_len, scale = make_inputs(case, HEADS[heads])
    packed = pa.packed_attention_ref(q, k, v, slot, kv_len, scale)
    for i in range(len(slot)):
        one = slice(i, i + 1)
        alone = pa.packed_attention_ref(q[one], k, v, slot[one], kv_len[one], scale)
        assert torch.equal(packed[one], alone), f"token {i}"


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", list(HEADS))
def test_kernel_matches_reference_fp32(case, heads):
    args = make_inputs(case, HEADS[heads])
    out = pa.packed_attention_kernel(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    torch.testing.assert_close(out, pa.packed_attention_ref(*args), atol=FP32_TOL, rtol=FP32_TOL)


@needs_kernel
@pytest.mark.parametrize(
    "case,heads,dtype",
    [
        ("mixed", "pi05", torch.bfloat16),
        ("decode", "gqa", torch.bfloat16),
        ("prefill", "mqa", torch.float16),
        ("decode", "pi05", torch.float32),
    ],
)
def test_kernel_low_precision(case, heads, dtype):
    """Kernel error vs the fp32 reference at most about twice the reference's own error."""
    q, k, v, slot, kv_len, scale = make_inputs(case, HEADS[heads], dtype)
    exact = pa.packed_attention_ref(q.float(), k.float(), v.float(), slot, kv_len, scale)
    ref_err = (pa.packed_attention_ref(q, k, v, slot, kv_len, scale).float() - exact).abs().max()
    out = pa.packed_attention_kernel(q, k, v, slot, kv_len, scale)
    assert out.dtype == dtype
    err = (out.float() - exact).abs().max()
    tol = LOW_PRECISION_FACTOR * ref_err if dtype != torch.float32 else FP32_TOL
    assert err <= tol, f"kernel error {err:.3g} vs reference error {ref_err:.3g}"


@needs_kernel
def test_kernel_ignores_rows_past_kv_len_and_is_batch_invariant():
    q, k, v, slot, kv_len, scale = make_inputs("mixed", HEADS["gqa"])
    out = pa.packed_attention_kernel(q, k, v, slot, kv_len, scale)
    dirty_k, dirty_v = k.clone(), v.clone()
    for s in slot.unique().tolist():
        n = int(kv_len[slot == s].max())
        dirty_k[s, n:] = float("nan")
        dirty_v[s, n:] = float("nan")
    assert torch.equal(pa.packed_attention_kernel(q, dirty_k, dirty_v, slot, kv_len, scale), out)
    for i in (0, 4, 6):  # each token alone
        alone = pa.packed_attention_kernel(
            q[i : i + 1], k, v, slot[i : i + 1], kv_len[i : i + 1], scale
        )
        assert torch.equal(alone, out[i : i + 1]), f"token {i}"


@needs_kernel
def test_kernel_strided_inputs():
    """Views with padded head and row strides, as layer slices of a larger arena give."""
    hq, hkv, d = HEADS["gqa"]
    q, k, v, slot, kv_len, scale = make_inputs("decode", HEADS["gqa"])
    q_wide = torch.zeros(q.shape[0], hq, d + 8, device=DEVICE)
    q_wide[..., :d] = q
    kv = torch.zeros(2, N_SLOTS, MAX_LEN, hkv, d + 3, device=DEVICE)  # [K|V, S, T, Hkv, D+3]
    kv[0, ..., :d], kv[1, ..., :d] = k, v
    args = (q_wide[..., :d], kv[0, ..., :d], kv[1, ..., :d], slot, kv_len, scale)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    ref = pa.packed_attention_ref(q, k, v, slot, kv_len, scale)
    torch.testing.assert_close(pa.packed_attention_kernel(*args), ref, atol=FP32_TOL, rtol=FP32_TOL)


@needs_kernel
def test_kernel_rejects_bad_inputs():
    q, k, v, slot, kv_len, scale = make_inputs("single", HEADS["mqa"])
    with pytest.raises(ValueError):
        pa.packed_attention_kernel(q, k.half(), v, slot, kv_len, scale)
    with pytest.raises(RuntimeError):
        pa.packed_attention_kernel(q[..., ::2], k[..., ::2], v[..., ::2], slot, kv_len, scale)
    with pytest.raises(RuntimeError):
        big = torch.zeros(1, 1, 1, 512, device=DEVICE)
        pa.packed_attention_kernel(
            torch.zeros(1, 1, 512, device=DEVICE), big, big, slot, kv_len, scale
        )
