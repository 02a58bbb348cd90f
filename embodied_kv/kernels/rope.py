"""Rotary embedding (HF half-split layout) as one kernel.

    out = x * cos + swap_halves(x) * sin      cos = [c, c], sin = [-s, s] per position

In torch this is 6 kernels (cast up, swap, two products, sum, cast down) per rotated
tensor; the action expert rotates its q and k in every layer of every Euler step (pi05:
~1,000 kernels per action). Here one program rotates every head of one token in fp32
registers, reading the swapped half by its offset instead of materialising it.

Supported range: x [N, H, D] fp32, bf16 or fp16, any token and head strides with a
contiguous last dim, D even and <= 256, H <= 64; cos / sin [N, 1, D] fp32 (`Rope.at`).
`rope_ref` is the model's torch code: the CPU runs it, so CPU bytes are unchanged.
"""

from __future__ import annotations

import torch

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    Launch,
    as_dtype,
    pow2,
    tl,
    triton,
    use_kernel,
)

MAX_HEAD_DIM = 256
MAX_HEADS = 64


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by full-width tables cos, sin [N, 1, D] (fp32), x's dtype."""
    xf = x.float()
    swapped = xf.roll(xf.shape[-1] // 2, dims=-1)  # [x2, x1]: the halves swapped
    return as_dtype(xf * cos + swapped * sin, x.dtype)


if triton is not None:
    from embodied_kv.kernels.triton_base import round_bf16

    @triton.jit
    def rotated(x, xs, cos, sin, ROUND_BF16: tl.constexpr):
        """x * cos + xs * sin (xs: x with its halves swapped) in fp32, rounded as this
        module's kernel stores it, in x's dtype: the one RoPE arithmetic of every kernel that
        rotates (kernels/expert_attention.py rotates its q and suffix k as it loads them)."""
        y = x.to(tl.float32) * cos + xs.to(tl.float32) * sin
        return round_bf16(y, ROUND_BF16).to(x.dtype)

    @triton.jit
    def rotated_heads(base, offs_d, swap_d, mask, cos, sin, ROUND_BF16: tl.constexpr):
        """The heads at `base` [H, 1] (one token's), loaded with their halves swapped beside
        them and `rotated`: this kernel's rows and kernels/rope_store.py's."""
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
        xs = tl.load(base + swap_d[None, :], mask=mask, other=0.0)
        return rotated(x, xs, cos, sin, ROUND_BF16)

    @triton.jit
    def rotated_rows(x_at, tab_at, live, cos_ptr, sin_ptr, HALF: tl.constexpr,
                     ROUND_BF16: tl.constexpr):  # fmt: skip
        """Rows x [R, 2 HALF] at `x_at` [R, 1] rotated with `rotated`'s bytes, read by
        halves (Rope's tables are [c, c] and [-s, s]: the low half's sine is the exact
        negation of the high one's)."""
        offs_h = tl.arange(0, HALF)[None, :]
        x_lo = tl.load(x_at + offs_h, mask=live, other=0.0)
        x_hi = tl.load(x_at + HALF + offs_h, mask=live, other=0.0)
        c = tl.load(cos_ptr + tab_at + offs_h, mask=live, other=0.0)
        s = tl.load(sin_ptr + tab_at + HALF + offs_h, mask=live, other=0.0)
        y = tl.join(rotated(x_lo, x_hi, c, -s, ROUND_BF16), rotated(x_hi, x_lo, c, s, ROUND_BF16))
        return tl.reshape(tl.permute(y, (0, 2, 1)), (x_lo.shape[0], 2 * HALF))

    @triton.jit
    def _rope_fwd(
        x_ptr,  # [N, H, D] input
        cos_ptr,  # [N, 1, D] fp32 [c, c] per token
        sin_ptr,  # [N, 1, D] fp32 [-s, s] per token
        out_ptr,  # [N, H, D] contiguous output, x's dtype
        n_heads,  # H
        stride_xn,  # x stride over tokens (elements)
        stride_xh,  # x stride over heads
        stride_cn,  # cos / sin stride over tokens
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,  # H rounded up to a power of two
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):
        tok = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        mask = (offs_h[:, None] < n_heads) & mask_d[None, :]
        swap_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        base = x_ptr + tok * stride_xn + offs_h[:, None] * stride_xh
        cos = tl.load(cos_ptr + tok * stride_cn + offs_d, mask=mask_d, other=0.0)
        sin = tl.load(sin_ptr + tok * stride_cn + offs_d, mask=mask_d, other=0.0)
        y = rotated_heads(base, offs_d, swap_d, mask, cos[None, :], sin[None, :], ROUND_BF16)
        out = out_ptr + tok * n_heads * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def rope_on_load(d: int) -> bool:
    """A head_dim `rotated_rows` takes (it reads a row's two halves as two tiles): a power of
    two. kernels/expert_attention.py rotates q and the suffix k itself for these; others are
    rotated before it."""
    return d >= 2 and d == pow2(d)


def check_tables(cos: torch.Tensor, sin: torch.Tensor, n: int, d: int, who: str) -> None:
    """ValueError unless cos and sin are `Rope.at` tables for n tokens of head_dim d: fp32
    [n, 1, d] with a contiguous last dim and one token stride (every rotating kernel's)."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, 1, d) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(
                f"{who}: {name} must be fp32 [{n}, 1, {d}] with a contiguous last dim, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"{who}: cos and sin strides differ: {cos.stride(0)} vs {sin.stride(0)}")


def plan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> Launch:
    """The one launch of a rotation: grid (N,), one token's H x D values per program."""
    n, h, d = x.shape
    return Launch(
        name=f"rope {str(x.dtype).removeprefix('torch.')} H={h} D={d}",
        kernel=_rope_fwd,
        grid=(n,),
        args=(x, cos, sin, out, h, x.stride(0), x.stride(1), cos.stride(0)),
        constexprs={
            "HEAD_DIM": d,
            "BLOCK_H": pow2(h, 1),
            "BLOCK_D": pow2(d),
            "ROUND_BF16": INTERPRETED and out.dtype == torch.bfloat16,
        },
        num_warps=4,
        num_stages=1,
    )


def rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("the RoPE kernel needs triton, which is not installed")
    n, h, d = x.shape
    if d % 2 or d > MAX_HEAD_DIM or h > MAX_HEADS or x.stride(-1) != 1:
        raise RuntimeError(
            f"rope kernel: head_dim {d} (even, <= {MAX_HEAD_DIM}), heads {h} (<= {MAX_HEADS}) "
            "and a contiguous last dim needed"
        )
    check_tables(cos, sin, n, d, "rope kernel")
    out = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
    plan_rope(x, cos, sin, out).run()
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if use_kernel(x):
        out = try_kernel("rope", rope_kernel, x, cos, sin)
        if out is not None:
            return out
    return rope_ref(x, cos, sin)


def adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q [N, Hq, D] and k [N, Hkv, D] are consecutive heads of one buffer (the fused q/k/v
    GEMM's output, model/fused.py): one [N, Hq + Hkv, D] view covers both."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.device != k.device:
        return False
    n, hq, d = q.shape
    return (
        k.shape[0] == n
        and k.shape[2] == d
        and q.stride() == k.stride()
        and q.stride(1) == d
        and q.stride(2) == 1
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and k.storage_offset() == q.storage_offset() + hq * d
    )


def adjacent_view(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] and k [N, Hkv, D] as the one [N, Hq + Hkv, D] view they are parts of
    (`adjacent_heads` holds)."""
    n, hq, d = q.shape
    return q.as_strided((n, hq + k.shape[1], d), q.stride(), q.storage_offset())


def rope_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the same tables. On CUDA, where they are adjacent heads of one
    buffer, one kernel over both (q and k then views of its [N, Hq + Hkv, D] output); else,
    and on a CPU, one call each: the same bytes (RoPE is elementwise per head)."""
    if use_kernel(q, k) and adjacent_heads(q, k):
        out = try_kernel("rope", rope_kernel, adjacent_view(q, k), cos, sin)
        if out is not None:
            hq = q.shape[1]
            return out[:, :hq], out[:, hq:]
    return rope(q, cos, sin), rope(k, cos, sin)
