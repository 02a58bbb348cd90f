"""RoPE on a step's q and k, and its K/V written into their arena rows, in one kernel.

    q_out = rope(q)                          the attention's queries
    k_cache[slot[t], row[t]] = rope(k[t])    the step's keys, rotated, in place in the arena
    v_cache[slot[t], row[t]] = v[t]

In the backbone's layer (model/backbone.py) as torch runs it these are four launches a
layer (the rotation of q, of k, and two index_put copies into the arena: 36 of the latter
per pi05 prefill, ~4 us each on an H200, the profile's `index_elementwise_kernel`). Here one
program per token rotates its query and key heads with kernels/rope.py's arithmetic (the
same bytes) and stores the key and value rows where the step planner (storage/step.py) put
them; the rotated k is never materialised elsewhere.

Supported range: q [N, Hq, D], k and v [N, Hkv, D] of one dtype (fp32, bf16 or fp16) with
contiguous last dims and any token / head strides (the fused q/k/v GEMM's views); the arena
layer k_cache, v_cache [S, T, Hkv, D] in that dtype with a contiguous last dim; D even and
<= 256, Hq + Hkv <= 64; cos / sin [N, 1, D] fp32 (`Rope.at`). Preconditions not checked (a
check would read the device): 0 <= slot < S, 0 <= row < T, no two tokens on one row.
`rope_store_ref` is the model's torch code: the CPU runs it, so CPU bytes are unchanged.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.rope import MAX_HEAD_DIM, MAX_HEADS, check_tables, rope
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    KERNEL_DTYPES,
    Launch,
    as_dtype,
    pow2,
    tl,
    triton,
    use_kernel,
)


def rope_store_ref(q, k, v, cos, sin, k_cache, v_cache, slot, row) -> torch.Tensor:
    """q and k rotated (kernels/rope.py), k and v written at [slot, row] of the arena layer
    (cast to its dtype); returns the rotated q."""
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    k_cache[slot, row] = as_dtype(k, k_cache.dtype)
    v_cache[slot, row] = as_dtype(v, v_cache.dtype)
    return q


if triton is not None:
    from embodied_kv.kernels.rope import rotated_heads

    @triton.jit
    def _rope_store_fwd(
        q_ptr,  # [N, Hq, D]
        k_ptr,  # [N, Hkv, D]
        v_ptr,  # [N, Hkv, D]
        cos_ptr,  # [N, 1, D] fp32 [c, c] per token
        sin_ptr,  # [N, 1, D] fp32 [-s, s] per token
        kc_ptr,  # [S, T, Hkv, D] keys of one arena layer
        vc_ptr,  # [S, T, Hkv, D] values
        slot_ptr,  # [N] int slot of each token
        row_ptr,  # [N] int arena row of each token
        out_ptr,  # [N, Hq, D] contiguous rotated q
        n_q,  # Hq
        n_kv,  # Hkv
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
        stride_cn,  # cos / sin stride over tokens
        stride_ks, stride_kt, stride_kch, stride_vs, stride_vt, stride_vch,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,  # Hq rounded up to a power of two (>= Hkv)
        BLOCK_D: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):  # fmt: skip
        tok = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        swap_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        cos = tl.load(cos_ptr + tok * stride_cn + offs_d, mask=mask_d, other=0.0)[None, :]
        sin = tl.load(sin_ptr + tok * stride_cn + offs_d, mask=mask_d, other=0.0)[None, :]
        # queries
        mask = (offs_h[:, None] < n_q) & mask_d[None, :]
        base = q_ptr + tok * stride_qn + offs_h[:, None] * stride_qh
        out = out_ptr + tok * n_q * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out, rotated_heads(base, offs_d, swap_d, mask, cos, sin, ROUND_BF16), mask=mask)
        # keys (rotated) and values, into the arena row of this token
        s = tl.load(slot_ptr + tok).to(tl.int64)
        r = tl.load(row_ptr + tok).to(tl.int64)
        mask = (offs_h[:, None] < n_kv) & mask_d[None, :]
        base = k_ptr + tok * stride_kn + offs_h[:, None] * stride_kh
        k = rotated_heads(base, offs_d, swap_d, mask, cos, sin, ROUND_BF16)
        dst = kc_ptr + s * stride_ks + r * stride_kt + offs_h[:, None] * stride_kch
        tl.store(dst + offs_d[None, :], k, mask=mask)
        v = tl.load(v_ptr + tok * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask, other=0.0)  # fmt: skip
        dst = vc_ptr + s * stride_vs + r * stride_vt + offs_h[:, None] * stride_vch
        tl.store(dst + offs_d[None, :], v, mask=mask)


def plan_rope_store(q, k, v, cos, sin, k_cache, v_cache, slot, row, out) -> Launch:
    """The one launch: grid (N,), one token's heads per program (inputs already validated)."""
    n, hq, d = q.shape
    return Launch(
        name=f"rope_store {str(q.dtype).removeprefix('torch.')} H={hq}+{k.shape[1]} D={d}",
        kernel=_rope_store_fwd,
        grid=(n,),
        args=(q, k, v, cos, sin, k_cache, v_cache, slot, row, out, hq, k.shape[1],
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3]),  # fmt: skip
        constexprs={
            "HEAD_DIM": d,
            "BLOCK_H": pow2(max(hq, k.shape[1]), 1),
            "BLOCK_D": pow2(d),
            "ROUND_BF16": INTERPRETED and q.dtype == torch.bfloat16,
        },
        num_warps=4,
        num_stages=1,
    )


def supported(q, k, v, k_cache, v_cache) -> bool:
    """What the kernel takes beyond the shapes: one dtype of KERNEL_DTYPES for the step's
    q/k/v and the arena layer, contiguous last dims, D even and <= 256, Hq + Hkv <= 64."""
    tensors = (q, k, v, k_cache, v_cache)
    d = q.shape[-1]
    return (
        {t.dtype for t in tensors} == {q.dtype}
        and q.dtype in KERNEL_DTYPES
        and all(t.stride(-1) == 1 for t in tensors)
        and d % 2 == 0
        and d <= MAX_HEAD_DIM
        and q.shape[1] + k.shape[1] <= MAX_HEADS
    )


def rope_store_kernel(q, k, v, cos, sin, k_cache, v_cache, slot, row) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1) -> rotated q."""
    if triton is None:
        raise RuntimeError("the RoPE + K/V store kernel needs triton, which is not installed")
    n, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (n, hkv, d) or v.shape != k.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(
            f"shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, arena "
            f"{tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or slot.shape != (n,) or row.shape != (n,):
        raise ValueError(f"v_cache, slot [{n}] and row [{n}] must match k_cache and q")
    if not supported(q, k, v, k_cache, v_cache):
        raise RuntimeError(
            f"rope_store kernel: one dtype of {KERNEL_DTYPES}, head_dim {d} (even, <= "
            f"{MAX_HEAD_DIM}), heads {hq}+{hkv} (<= {MAX_HEADS}), contiguous last dims needed"
        )
    check_tables(cos, sin, n, d, "rope_store")
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    plan_rope_store(q, k, v, cos, sin, k_cache, v_cache, slot, row, out).run()
    return out


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slot, row, fused=True) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere. Returns the
    rotated q; the rotated k and v are in the arena. `fused=False`: the reference's ops
    (each RoPE dispatched: kernels on CUDA), as the backbone ran before this kernel (bench
    latency's `graphs_prev`)."""
    if fused and use_kernel(q, k, v, k_cache, v_cache) and supported(q, k, v, k_cache, v_cache):
        out = try_kernel("rope_store", rope_store_kernel, q, k, v, cos, sin, k_cache, v_cache,
                         slot, row)  # fmt: skip
        if out is not None:
            return out
    return rope_store_ref(q, k, v, cos, sin, k_cache, v_cache, slot, row)


def pi05_launches() -> list[Launch]:
    """The launch at a pi05 prefill's shapes (704 tokens, 8 + 1 heads of 256, bf16) on meta
    tensors, for kernels/offline_compile.py."""
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    qkv = torch.empty(704, 10, 256, **meta)
    q, k, v = qkv[:, :8], qkv[:, 8:9], qkv[:, 9:]
    tab = torch.empty(704, 1, 256, device="meta")
    cache = torch.empty(4, 2048, 1, 256, **meta)
    idx = torch.empty(704, dtype=torch.int64, device="meta")
    return [plan_rope_store(q, k, v, tab, tab, cache, cache, idx, idx, torch.empty(704, 8, 256,
                            **meta))]  # fmt: skip
