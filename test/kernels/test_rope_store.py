"""RoPE on q and k with the K/V written into the arena in one kernel (kernels/rope_store.py)
against `rope_store_ref` (the two rotations, then the two index_put copies: the CPU's bytes);
interpreter on CPU, compiled on a GPU: q/k/v as views of the fused q/k/v output, tokens of
several slots on scattered rows (a mixed step), the arena's other rows untouched."""

import pytest
import torch

from embodied_kv.kernels.rope_store import rope_store, rope_store_kernel, rope_store_ref, supported
from embodied_kv.model.layers import Rope

from .conftest import DEVICE, HEADS


def inputs(n, heads, dtype, seed=0, slots=3, rows=40):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).to(dtype).to(DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    cache = torch.randn(2, slots, rows, hkv, d, generator=g).to(dtype).to(DEVICE)
    flat = torch.randperm(slots * rows, generator=g)[:n]  # distinct (slot, row) pairs
    slot, row = (flat // rows).to(DEVICE), (flat % rows).to(DEVICE)
    rope = Rope(d, 4096, 10000.0).to(DEVICE)
    rope.reset_tables()
    cos, sin = rope.at(torch.randint(0, 4096, (n,), generator=g).to(DEVICE))
    return q, k, v, cos, sin, cache, slot, row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "heads"), [(13, "pi05"), (37, "gqa3"), (5, "gqa2"), (1, "mha")])
def test_kernel_is_the_reference_bytewise(kernel, dtype, n, heads):
    q, k, v, cos, sin, cache, slot, row = inputs(n, HEADS[heads], dtype, seed=n)
    ours, theirs = cache.clone(), cache.clone()
    got = rope_store_kernel(q, k, v, cos, sin, ours[0], ours[1], slot, row)
    want = rope_store_ref(q, k, v, cos, sin, theirs[0], theirs[1], slot, row)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(ours, theirs)  # the step's rows written, every other row untouched
    assert not torch.equal(ours, cache)


def test_dispatch_and_support():
    """The dispatcher's bytes are the reference's on this device; an arena of another dtype
    than the step's (the kernel stores without a cast) is not the kernel's."""
    q, k, v, cos, sin, cache, slot, row = inputs(9, HEADS["gqa3"], torch.float32)
    ours, theirs = cache.clone(), cache.clone()
    got = rope_store(q, k, v, cos, sin, ours[0], ours[1], slot, row)
    want = rope_store_ref(q, k, v, cos, sin, theirs[0], theirs[1], slot, row)
    assert torch.equal(got, want) and torch.equal(ours, theirs)
    assert supported(q, k, v, cache[0], cache[1])
    half = cache.to(torch.bfloat16)
    assert not supported(q, k, v, half[0], half[1])


def test_bad_shapes_are_refused(kernel):
    q, k, v, cos, sin, cache, slot, row = inputs(9, HEADS["gqa3"], torch.float32)
    with pytest.raises(ValueError, match="slot"):
        rope_store_kernel(q, k, v, cos, sin, cache[0], cache[1], slot[:-1], row)
    with pytest.raises(ValueError, match="cos"):
        rope_store_kernel(q, k, v, cos[:-1], sin, cache[0], cache[1], slot, row)
