"""pi0.5's adaptive RMSNorm folded into the q/k/v GEMM, RoPE in the epilogue.

    norm_qkv_rope  xn = rms_norm(h) * (1 + scale) + shift;  q, k, v = xn W_qkv^T;  rope(q), rope(k)

The shared prologue (the rows' RMS, each h tile normalised and modulated in registers) is
kernels/norm_prologue.py; here the epilogue holds the columns d and d + D/2 of a head in two
fp32 accumulators and rotates them before the one rounding to h's dtype.

Supported range: as kernels/norm_prologue.py for h, scale1, shift and the weight (q, k, v
rows); head_dim D even; cos / sin [N, 1, D] fp32 (`Rope.at`). Outputs in h's dtype: q, k, v
as views of one [N, Hq + 2 Hkv, D] buffer (v has the token stride of the fused GEMM's output,
as today).

The reference `norm_qkv_rope_ref` is the model's CPU chain (AdaRMSNorm.modulate, one GEMM per
projection as `Attention.qkv` runs without model/fused.py, Rope.rotate): the CPU runs it, so
CPU bytes are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.norm_prologue import (
    PI05_EXPERT,
    check_common,
    numerics,
    pick_block_k,
    pick_block_m,
    tag,
)
from embodied_kv.kernels.rms_norm import rms_norm_ref
from embodied_kv.kernels.rope import check_tables, rope_ref
from embodied_kv.kernels.triton_base import Launch, pow2, tl, triton, use_kernel

# Tiles timed on an H200 (bench/kernel_sweep.py, 2026-12-04, pi05, 18 layers' weights from
# HBM in one graph), bf16, 4 warps, 3 stages: K 128 x 16 columns of each half-head (10 heads
# x 8 = 80 programs) 20.0 us a call, against 26.2 us at K 64 x 16 (before); K 256 x 32 was
# 19.5 us but spills (255 registers, 216 spill stores at sm_90, triton 3.9 offline compile),
# K 256 x 16 20.5 us; 8 warps lost everywhere. fp32 keeps K 64 (pick_block_k).
QKV_BLOCK_K = 128
QKV_BLOCK_H = 16


def norm_qkv_rope_ref(
    h: torch.Tensor,  # [N, W] residual stream
    scale1: torch.Tensor,  # [W] fp32, 1 + scale
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_qkv: torch.Tensor,  # [(Hq + 2 Hkv) * D, W]: q rows, k rows, v rows
    sizes: list[int],  # [Hq * D, Hkv * D, Hkv * D]
    cos: torch.Tensor,  # [N, 1, D] fp32
    sin: torch.Tensor,  # [N, 1, D] fp32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [N, Hq, D], k [N, Hkv, D] rotated, v [N, Hkv, D]; h's dtype."""
    n, d = h.shape[0], cos.shape[-1]
    xn = rms_norm_ref(h, scale1, eps, shift)
    # one GEMM per projection, as the CPU model runs them (fused GEMMs are CUDA-only)
    q, k, v = (F.linear(xn, w).view(n, -1, d) for w in w_qkv.split(sizes))
    return rope_ref(q, cos, sin), rope_ref(k, cos, sin), v


if triton is not None:
    from embodied_kv.kernels.norm_prologue import norm_dot_pair
    from embodied_kv.kernels.triton_base import round_bf16

    def norm_qkv_rope_tile_fn(
        pid_m,  # row block
        pid_p,  # column program: a chunk of a head's two halves
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [heads * D, W] fused q/k/v weight, h's dtype
        cos_ptr,  # [N, 1, D] fp32 [c, c] per row
        sin_ptr,  # [N, 1, D] fp32 [-s, s] per row
        out_ptr,  # [N, heads, D] contiguous output: q heads, k heads, v heads
        n_rows,  # N
        width,  # W
        rope_heads,  # Hq + Hkv: heads rotated (the v heads after them are not)
        eps,
        stride_h,  # h stride over rows (elements)
        stride_w,  # weight stride over rows
        stride_c,  # cos / sin stride over rows
        stride_o,  # out stride over rows (heads * D)
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,  # columns of each half-head per program
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        # grid (cdiv(N, BLOCK_M), heads * cdiv(D/2, BLOCK_H)): program (m, p) owns rows
        # [m*BLOCK_M, ...) and, of head p // chunks, the columns j and j + D/2 for j in its
        # chunk p % chunks of [0, D/2): the two halves a rotation mixes
        HALF: tl.constexpr = HEAD_DIM // 2
        chunks = tl.cdiv(HALF, BLOCK_H)
        head = pid_p // chunks
        offs_j = (pid_p % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_j = offs_j < HALF
        cols_lo = head * HEAD_DIM + offs_j
        cols_hi = cols_lo + HALF
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < n_rows
        acc_lo, acc_hi = norm_dot_pair(
            h_ptr, scale_ptr, shift_ptr, w_ptr, rows, mask_m, cols_lo, cols_hi, mask_j, width,
            eps, stride_h, stride_w, BLOCK_M, BLOCK_H, BLOCK_K, ROUND_BF16, DOT_IN_FP32,
            INPUT_PRECISION,
        )  # fmt: skip
        mask = mask_m[:, None] & mask_j[None, :]
        if head < rope_heads:
            # rope_ref: out[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d]
            tab = rows[:, None] * stride_c + offs_j[None, :]
            cos_lo = tl.load(cos_ptr + tab, mask=mask, other=0.0)
            sin_lo = tl.load(sin_ptr + tab, mask=mask, other=0.0)
            cos_hi = tl.load(cos_ptr + tab + HALF, mask=mask, other=0.0)
            sin_hi = tl.load(sin_ptr + tab + HALF, mask=mask, other=0.0)
            lo = acc_lo * cos_lo + acc_hi * sin_lo
            hi = acc_hi * cos_hi + acc_lo * sin_hi
        else:
            lo = acc_lo
            hi = acc_hi
        out = out_ptr + rows[:, None] * stride_o + cols_lo[None, :]
        tl.store(out, round_bf16(lo, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, round_bf16(hi, ROUND_BF16).to(out_ptr.dtype.element_ty), mask=mask)

    # the kernel's body: inlined in its kernel, a call in a persistent kernel's loop
    norm_qkv_rope_tile = triton.jit(norm_qkv_rope_tile_fn)
    norm_qkv_rope_tile_call = triton.jit(noinline=True)(norm_qkv_rope_tile_fn)

    @triton.jit
    def _norm_qkv_rope_fwd(
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [heads * D, W] fused q/k/v weight, h's dtype
        cos_ptr,  # [N, 1, D] fp32 [c, c] per row
        sin_ptr,  # [N, 1, D] fp32 [-s, s] per row
        out_ptr,  # [N, heads, D] contiguous output: q heads, k heads, v heads
        n_rows,  # N
        width,  # W
        rope_heads,  # Hq + Hkv: heads rotated (the v heads after them are not)
        eps,
        stride_h,  # h stride over rows (elements)
        stride_w,  # weight stride over rows
        stride_c,  # cos / sin stride over rows
        stride_o,  # out stride over rows (heads * D)
        HEAD_DIM: tl.constexpr,  # D
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,  # columns of each half-head per program
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        norm_qkv_rope_tile(
            tl.program_id(0), tl.program_id(1), h_ptr, scale_ptr, shift_ptr, w_ptr,
            cos_ptr, sin_ptr, out_ptr, n_rows, width, rope_heads, eps, stride_h,
            stride_w, stride_c, stride_o, HEAD_DIM, BLOCK_M, BLOCK_H, BLOCK_K,
            ROUND_BF16, DOT_IN_FP32, INPUT_PRECISION,
        )  # fmt: skip


def plan_norm_qkv_rope(
    h: torch.Tensor,  # [N, W]
    scale1: torch.Tensor,  # [W] fp32
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_qkv: torch.Tensor,  # [heads * D, W]
    rope_heads: int,  # Hq + Hkv
    cos: torch.Tensor,  # [N, 1, D] fp32
    sin: torch.Tensor,  # [N, 1, D] fp32
    out: torch.Tensor,  # [N, heads, D] contiguous
) -> Launch:
    """The one launch (inputs already validated): grid (cdiv(N, BLOCK_M), heads x
    cdiv(D/2, BLOCK_H)); at pi05 one row block of 64 x 80 column programs."""
    n, w = h.shape
    heads, d = out.shape[1], out.shape[2]
    block_h = min(QKV_BLOCK_H, pow2(d // 2))
    block_k = pick_block_k(h.dtype, QKV_BLOCK_K, w)
    strides = (h.stride(0), w_qkv.stride(0), cos.stride(0), out.stride(0))
    block_m = pick_block_m(n)
    return Launch(
        name=f"norm_qkv_rope {tag(h)} heads={rope_heads}+{heads - rope_heads} D={d} "
        f"block_m={block_m} block_h={block_h} block_k={block_k}",
        kernel=_norm_qkv_rope_fwd,
        grid=(-(-n // block_m), heads * -(-(d // 2) // block_h)),
        args=(h, scale1, shift, w_qkv, cos, sin, out, n, w, rope_heads, eps, *strides),
        constexprs={
            "HEAD_DIM": d,
            "BLOCK_M": block_m,
            "BLOCK_H": block_h,
            "BLOCK_K": block_k,
            **numerics(h.dtype),
        },
        num_warps=4,
        num_stages=3,
    )


def norm_qkv_rope_kernel(h, scale1, shift, eps: float, w_qkv, sizes, cos, sin):
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); arguments as
    `norm_qkv_rope_ref`."""
    n, d = h.shape[0], cos.shape[-1]
    if len(sizes) != 3 or sizes[1] != sizes[2] or d % 2 or any(s <= 0 or s % d for s in sizes):
        raise ValueError(
            f"norm_qkv_rope: sizes {list(sizes)} must be [Hq * D, Hkv * D, Hkv * D] for the "
            f"tables' head_dim D = {d} (even)"
        )
    check_common(h, scale1, shift, w_qkv, sum(sizes), "norm_qkv_rope")
    check_tables(cos, sin, n, d, "norm_qkv_rope")
    hq, hkv = sizes[0] // d, sizes[1] // d
    out = torch.empty(n, hq + 2 * hkv, d, dtype=h.dtype, device=h.device)
    plan_norm_qkv_rope(h, scale1, shift, eps, w_qkv, hq + hkv, cos, sin, out).run()
    return out[:, :hq], out[:, hq : hq + hkv], out[:, hq + hkv :]


def norm_qkv_rope(h, scale1, shift, eps: float, w_qkv, sizes, cos, sin):
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(h, scale1, shift, w_qkv):
        out = try_kernel("norm_qkv_rope", norm_qkv_rope_kernel, h, scale1, shift, eps, w_qkv,
                         sizes, cos, sin)  # fmt: skip
        if out is not None:
            return out
    return norm_qkv_rope_ref(h, scale1, shift, eps, w_qkv, sizes, cos, sin)


def pi05_launches(dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The one launch at pi05 expert shapes, planned on `meta` tensors (for
    kernels/offline_compile.py)."""
    n, w, (hq, hkv, d) = (PI05_EXPERT[k] for k in ("rows", "width", "heads"))
    meta = {"dtype": dtype, "device": "meta"}
    h = torch.empty(n, w, **meta)
    vec = torch.empty(w, device="meta")
    table = torch.empty(n, 1, d, device="meta")
    heads = hq + 2 * hkv
    qkv = plan_norm_qkv_rope(
        h, vec, vec, 1e-6, torch.empty(heads * d, w, **meta), hq + hkv, table, table,
        torch.empty(n, heads, d, **meta),
    )  # fmt: skip
    return [qkv]
