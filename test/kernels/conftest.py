"""Shared inputs for the packed-attention tests: the reference and both Triton kernels.

Without a GPU the kernels run under the Triton interpreter on CPU tensors. Triton decorates
its own library (tl.zeros, ...) when first imported, so TRITON_INTERPRET must be set before
anything in the session imports triton: test/conftest.py does that for every run.
"""

import pytest
import torch

import embodied_kv.kernels.triton_base as tb

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_SLOTS, MAX_LEN = 5, 136  # MAX_LEN: not a multiple of any BLOCK_N

FP32_TOL = 1e-5  # kernels and naive loop vs reference, fp32 (different summation orders)
LOW_PRECISION_FACTOR = 2.0  # kernel error <= this x the reference's own 16-bit error (STYLE)

# (Hq, Hkv, D): groups 1 / 2 / 3 / 4 / 8, head_dims 16 / 32 / 48 (not a power of two) / 64 / 256
HEADS = {
    "mha": (4, 4, 64),
    "gqa2": (4, 2, 48),
    "gqa3": (6, 2, 16),
    "mqa4": (4, 1, 32),
    "pi05": (8, 1, 256),
}


def kernel_skip_reason() -> str | None:
    if tb.triton is None:
        return "triton is not installed"
    stdlib_compiled = isinstance(tb.tl.zeros, tb.triton.runtime.JITFunction)
    if DEVICE == "cpu" and (stdlib_compiled or not tb.INTERPRETED):
        return (
            "no GPU, and triton was imported before TRITON_INTERPRET=1 was set "
            "(test/conftest.py sets it)"
        )
    return None


@pytest.fixture
def kernel():
    """Skips a test that runs a Triton kernel where none can run."""
    reason = kernel_skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def make_inputs():
    def make(tokens, heads, dtype=torch.float32, seed=0):
        """tokens: (slot, kv_len) per token in packing order; heads: (Hq, Hkv, D).
        Returns q [N, Hq, D], k/v [S, T, Hkv, D], slot [N], kv_len [N], scale."""
        hq, hkv, d = heads
        gen = torch.Generator().manual_seed(seed)
        slot = torch.tensor([s for s, _ in tokens], dtype=torch.int64)
        kv_len = torch.tensor([n for _, n in tokens], dtype=torch.int64)
        q = torch.randn(len(slot), hq, d, generator=gen)
        k = torch.randn(N_SLOTS, MAX_LEN, hkv, d, generator=gen)
        v = torch.randn(N_SLOTS, MAX_LEN, hkv, d, generator=gen)
        to = {"dtype": dtype, "device": DEVICE}
        return q.to(**to), k.to(**to), v.to(**to), slot.to(DEVICE), kv_len.to(DEVICE), d**-0.5

    return make


def assert_low_precision_close(run, ref, q, k, v, slot, kv_len, scale):
    """`run(q, k, v, slot, kv_len, scale)` in q.dtype: its error vs the fp32 reference at most
    LOW_PRECISION_FACTOR x the reference's own error in that dtype (fp32: FP32_TOL)."""
    exact = ref(q.float(), k.float(), v.float(), slot, kv_len, scale)
    ref_err = (ref(q, k, v, slot, kv_len, scale).float() - exact).abs().max()
    out = run(q, k, v, slot, kv_len, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    err = (out.float() - exact).abs().max()
    tol = LOW_PRECISION_FACTOR * ref_err if q.dtype != torch.float32 else FP32_TOL
    assert err <= tol, f"kernel error {err:.3g} vs reference error {ref_err:.3g}"


@pytest.fixture
def low_precision_close():
    return assert_low_precision_close


@pytest.fixture
def fp32_close():
    def check(out, expected):
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL)

    return check


@pytest.fixture(params=list(HEADS))
def heads(request):
    """Every head configuration of HEADS, as (Hq, Hkv, D)."""
    return HEADS[request.param]
