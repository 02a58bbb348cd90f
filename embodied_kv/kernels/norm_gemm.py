"""pi0.5's adaptive RMSNorm folded into the GEMM that reads it: q/k/v with RoPE, gate/up with
the GELU gate.

    norm_qkv_rope  xn = rms_norm(h) * (1 + scale) + shift;  q, k, v = xn W_qkv^T;  rope(q), rope(k)
    norm_gate_up   xn as above;                             gelu_tanh(xn W_gate^T) * (xn W_up^T)

The action expert runs each of these chains in every layer of every Euler step on 50 rows
(pi05: 18 layers x 10 steps): norm, GEMM and RoPE (or GELU-gate) as 3-4 kernels that pass
the [50, W] / [50, F] activations through memory between them. Here one kernel does each:
a program owns a [BLOCK_M rows x BLOCK_N columns] output tile, computes its rows' RMS in a
prologue (one pass over K = W), then streams K, normalising and modulating each h tile in
registers, rounding it to h's dtype exactly where the unfused chain does (the norm's
output), and feeding it to the tensor-core dot. The epilogue sees both halves of what it
needs: for RoPE the columns d and d + D/2 of a head (two accumulators), for the gate the
same columns of gate and up (two accumulators), so the fp32 accumulators are rotated or
gated before the one rounding to h's dtype.

Supported range: h [N, W] fp32, bf16 or fp16 with a contiguous last dim (any row stride);
scale1 (1 + scale) and shift contiguous fp32 [W]; weights [out, W] in h's dtype with a
contiguous last dim (`RowFusion.weight`: q, k, v rows / gate, up rows); head_dim D even;
cos / sin [N, 1, D] fp32 (`Rope.at`). Outputs in h's dtype: q, k, v as views of one
[N, Hq + 2 Hkv, D] buffer (v has the token stride of the fused GEMM's output, as today),
the gated MLP activation contiguous [N, F].

The references `norm_qkv_rope_ref` / `norm_gate_up_ref` are the model's CPU chain
(AdaRMSNorm.modulate, one GEMM per projection as `Attention.qkv` / `GatedMLP` run without
model/fused.py, Rope.rotate, gelu_gate): the CPU runs them, so CPU bytes are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embodied_kv.kernels.gelu_gate import gelu_gate_ref
from embodied_kv.kernels.rms_norm import rms_norm_ref
from embodied_kv.kernels.rope import rope_ref
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    KERNEL_DTYPES,
    Launch,
    pow2,
    tl,
    triton,
    use_kernel,
)

MAX_BLOCK_M = 64  # rows per program: a Hopper warpgroup MMA's M; pi05's 50 rows in one block
BLOCK_K = 64
QKV_BLOCK_H = 16  # columns of each half-head per program: pi05 -> 10 heads x 8 = 80 programs
GATE_BLOCK_N = 32  # gate (and up) columns per program: pi05 F = 4096 -> 128 programs
# pi05's action expert (model/config.py PRESETS["pi05"].expert, action_horizon): 50 action
# rows (velocity_at runs them unpadded), width 1024, 8 query heads / 1 KV head of 256, MLP 4096
PI05_EXPERT = {"rows": 50, "width": 1024, "heads": (8, 1, 256), "mlp": 4096}


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


def norm_gate_up_ref(
    h: torch.Tensor,  # [N, W]
    scale1: torch.Tensor,  # [W] fp32
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_gate_up: torch.Tensor,  # [2F, W]: gate rows, then up rows
    hidden: int,  # F
) -> torch.Tensor:
    """-> gelu_tanh(xn W_gate^T) * (xn W_up^T) [N, F], h's dtype."""
    xn = rms_norm_ref(h, scale1, eps, shift)
    w_gate, w_up = w_gate_up.split(hidden)
    return gelu_gate_ref(F.linear(xn, w_gate), F.linear(xn, w_up))


if triton is not None:
    from embodied_kv.kernels.triton_base import dot, round_bf16

    @triton.jit
    def _inv_rms(
        h_ptr,  # [N, W] rows
        rows,  # [BLOCK_M] row indices
        mask_m,  # [BLOCK_M] rows < N
        width,  # W
        eps,
        stride_h,  # h stride over rows
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """[BLOCK_M] fp32 1 / rms of each row (rms_norm: mean square + eps, one pass)."""
        offs_k = tl.arange(0, BLOCK_K)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            kk = k0 + offs_k
            mask = mask_m[:, None] & (kk < width)[None, :]
            x = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            sq += tl.sum(x * x, axis=1)
        return 1.0 / tl.sqrt(sq / width + eps)

    @triton.jit
    def _modulated_tile(
        h_ptr,  # [N, W] rows
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        rows,  # [BLOCK_M] row indices
        mask_m,  # [BLOCK_M] rows < N
        inv,  # [BLOCK_M] fp32 1 / rms
        kk,  # [BLOCK_K] column indices of h
        width,  # W
        stride_h,  # h stride over rows
        ROUND_BF16: tl.constexpr,
    ):
        """[BLOCK_M, BLOCK_K] of the norm's output in h's dtype: (x / rms) * scale1 + shift,
        zeros past W (rows past N hold `shift`; their outputs are never stored)."""
        mask_k = kk < width
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(h_ptr + rows[:, None] * stride_h + kk[None, :], mask=mask, other=0.0)
        s = tl.load(scale_ptr + kk, mask=mask_k, other=0.0)
        b = tl.load(shift_ptr + kk, mask=mask_k, other=0.0)
        y = (x.to(tl.float32) * inv[:, None]) * s[None, :] + b[None, :]
        return round_bf16(y, ROUND_BF16).to(h_ptr.dtype.element_ty)

    @triton.jit
    def _weight_tile(
        w_ptr,  # [R, W] weight rows
        cols,  # [BLOCK_N] weight rows (output columns)
        mask_n,  # [BLOCK_N] which of them exist
        kk,  # [BLOCK_K]
        width,  # W
        stride_w,  # weight stride over rows
    ):
        """[BLOCK_K, BLOCK_N] of W^T, zeros outside."""
        mask = (kk < width)[:, None] & mask_n[None, :]
        return tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=mask, other=0.0)

    @triton.jit
    def _norm_dot_pair(
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [out, W] weight, h's dtype
        rows,  # [BLOCK_M] row indices
        mask_m,  # rows < N
        cols_a,  # [BLOCK_N] weight rows of the first accumulator
        cols_b,  # [BLOCK_N] weight rows of the second (RoPE's other half, or up beside gate)
        mask_c,  # [BLOCK_N] valid columns
        width,  # W = K
        eps,
        stride_h,
        stride_w,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # The prologue (the rows' RMS), then K streamed once: each h tile normalised and
        # modulated in registers, dotted with both weight tiles -> two fp32 [M, N] accumulators
        inv = _inv_rms(h_ptr, rows, mask_m, width, eps, stride_h, BLOCK_M, BLOCK_K)
        acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, width, BLOCK_K):
            kk = k0 + offs_k
            x = _modulated_tile(
                h_ptr, scale_ptr, shift_ptr, rows, mask_m, inv, kk, width, stride_h, ROUND_BF16
            )
            acc_a = dot(x, _weight_tile(w_ptr, cols_a, mask_c, kk, width, stride_w), acc_a,
                        DOT_IN_FP32, INPUT_PRECISION)  # fmt: skip
            acc_b = dot(x, _weight_tile(w_ptr, cols_b, mask_c, kk, width, stride_w), acc_b,
                        DOT_IN_FP32, INPUT_PRECISION)  # fmt: skip
        return acc_a, acc_b

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
        # grid (cdiv(N, BLOCK_M), heads * cdiv(D/2, BLOCK_H)): program (m, p) owns rows
        # [m*BLOCK_M, ...) and, of head p // chunks, the columns j and j + D/2 for j in its
        # chunk p % chunks of [0, D/2): the two halves a rotation mixes
        HALF: tl.constexpr = HEAD_DIM // 2
        chunks = tl.cdiv(HALF, BLOCK_H)
        head = tl.program_id(1) // chunks
        offs_j = (tl.program_id(1) % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_j = offs_j < HALF
        cols_lo = head * HEAD_DIM + offs_j
        cols_hi = cols_lo + HALF
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < n_rows
        acc_lo, acc_hi = _norm_dot_pair(
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

    @triton.jit
    def _norm_gate_up_fwd(
        h_ptr,  # [N, W] residual stream, contiguous last dim
        scale_ptr,  # [W] fp32 1 + scale
        shift_ptr,  # [W] fp32 shift
        w_ptr,  # [2F, W] fused gate/up weight, h's dtype
        out_ptr,  # [N, F] contiguous output
        n_rows,  # N
        width,  # W
        hidden,  # F
        eps,
        stride_h,  # h stride over rows (elements)
        stride_w,  # weight stride over rows
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # gate (and up) columns per program
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        # grid (cdiv(N, BLOCK_M), cdiv(F, BLOCK_N)): program (m, c) owns rows [m*BLOCK_M, ...)
        # and features [c*BLOCK_N, ...): gate rows cols of the weight and up rows F + cols
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < hidden
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < n_rows
        g, acc_u = _norm_dot_pair(
            h_ptr, scale_ptr, shift_ptr, w_ptr, rows, mask_m, cols, cols + hidden, mask_n,
            width, eps, stride_h, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, ROUND_BF16, DOT_IN_FP32,
            INPUT_PRECISION,
        )  # fmt: skip
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi): torch's tanh GELU
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        y = round_bf16(0.5 * g * (1.0 + tanh) * acc_u, ROUND_BF16)
        mask = mask_m[:, None] & mask_n[None, :]
        out = out_ptr + rows[:, None] * hidden + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def _numerics(dtype: torch.dtype) -> dict[str, object]:
    return {
        "ROUND_BF16": INTERPRETED and dtype == torch.bfloat16,
        "DOT_IN_FP32": INTERPRETED,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _block_m(n: int) -> int:
    return min(MAX_BLOCK_M, pow2(n))


def _tag(h: torch.Tensor) -> str:
    return f"{str(h.dtype).removeprefix('torch.')} N={h.shape[0]} W={h.shape[1]}"


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
    strides = (h.stride(0), w_qkv.stride(0), cos.stride(0), out.stride(0))
    block_m = _block_m(n)
    return Launch(
        name=f"norm_qkv_rope {_tag(h)} heads={rope_heads}+{heads - rope_heads} D={d} "
        f"block_m={block_m} block_h={block_h}",
        kernel=_norm_qkv_rope_fwd,
        grid=(-(-n // block_m), heads * -(-(d // 2) // block_h)),
        args=(h, scale1, shift, w_qkv, cos, sin, out, n, w, rope_heads, eps, *strides),
        constexprs={
            "HEAD_DIM": d,
            "BLOCK_M": block_m,
            "BLOCK_H": block_h,
            "BLOCK_K": BLOCK_K,
            **_numerics(h.dtype),
        },
        num_warps=4,
        num_stages=3,
    )


def plan_norm_gate_up(
    h: torch.Tensor,  # [N, W]
    scale1: torch.Tensor,  # [W] fp32
    shift: torch.Tensor,  # [W] fp32
    eps: float,
    w_gate_up: torch.Tensor,  # [2F, W]
    out: torch.Tensor,  # [N, F] contiguous
) -> Launch:
    """The one launch (inputs already validated): grid (cdiv(N, BLOCK_M), cdiv(F,
    BLOCK_N)); at pi05 one row block of 64 x 128 column programs."""
    n, w = h.shape
    hidden = out.shape[1]
    block_m = _block_m(n)
    block_n = min(GATE_BLOCK_N, pow2(hidden))
    strides = (h.stride(0), w_gate_up.stride(0))
    return Launch(
        name=f"norm_gate_up {_tag(h)} F={hidden} block_m={block_m} block_n={block_n}",
        kernel=_norm_gate_up_fwd,
        grid=(-(-n // block_m), -(-hidden // block_n)),
        args=(h, scale1, shift, w_gate_up, out, n, w, hidden, eps, *strides),
        constexprs={
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": BLOCK_K,
            **_numerics(h.dtype),
        },
        num_warps=4,
        num_stages=3,
    )


def _check_common(h, scale1, shift, weight, rows: int, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"the fused {what} kernel needs triton, which is not installed")
    if h.dim() != 2 or h.dtype not in KERNEL_DTYPES or h.stride(-1) != 1:
        raise ValueError(
            f"{what}: h must be [N, W] fp32 / bf16 / fp16 with a contiguous last dim, got "
            f"{h.dtype} {tuple(h.shape)} strides {h.stride()}"
        )
    w = h.shape[1]
    for name, t in (("scale1", scale1), ("shift", shift)):
        if t.shape != (w,) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"{what}: {name} must be a contiguous fp32 [{w}], got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    if weight.shape != (rows, w) or weight.dtype != h.dtype or weight.stride(-1) != 1:
        raise ValueError(
            f"{what}: weight must be {h.dtype} [{rows}, {w}] with a contiguous last dim, got "
            f"{weight.dtype} {tuple(weight.shape)}"
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
    _check_common(h, scale1, shift, w_qkv, sum(sizes), "norm_qkv_rope")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, 1, d) or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(
                f"norm_qkv_rope: {name} must be fp32 [{n}, 1, {d}] with a contiguous last "
                f"dim, got {t.dtype} {tuple(t.shape)}"
            )
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin strides differ: {cos.stride(0)} vs {sin.stride(0)}")
    hq, hkv = sizes[0] // d, sizes[1] // d
    out = torch.empty(n, hq + 2 * hkv, d, dtype=h.dtype, device=h.device)
    plan_norm_qkv_rope(h, scale1, shift, eps, w_qkv, hq + hkv, cos, sin, out).run()
    return out[:, :hq], out[:, hq : hq + hkv], out[:, hq + hkv :]


def norm_gate_up_kernel(h, scale1, shift, eps: float, w_gate_up, hidden: int) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); arguments as
    `norm_gate_up_ref`."""
    if hidden <= 0:
        raise ValueError(f"norm_gate_up: hidden must be positive, got {hidden}")
    _check_common(h, scale1, shift, w_gate_up, 2 * hidden, "norm_gate_up")
    out = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=h.device)
    plan_norm_gate_up(h, scale1, shift, eps, w_gate_up, out).run()
    return out


def norm_qkv_rope(h, scale1, shift, eps: float, w_qkv, sizes, cos, sin):
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(h, scale1, shift, w_qkv):
        return norm_qkv_rope_kernel(h, scale1, shift, eps, w_qkv, sizes, cos, sin)
    return norm_qkv_rope_ref(h, scale1, shift, eps, w_qkv, sizes, cos, sin)


def norm_gate_up(h, scale1, shift, eps: float, w_gate_up, hidden: int) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(h, scale1, shift, w_gate_up):
        return norm_gate_up_kernel(h, scale1, shift, eps, w_gate_up, hidden)
    return norm_gate_up_ref(h, scale1, shift, eps, w_gate_up, hidden)


def pi05_launches(dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """Both launches at pi05 expert shapes, planned on `meta` tensors (for
    kernels/offline_compile.py)."""
    n, w, (hq, hkv, d), hidden = (PI05_EXPERT[k] for k in ("rows", "width", "heads", "mlp"))
    meta = {"dtype": dtype, "device": "meta"}
    h = torch.empty(n, w, **meta)
    vec = torch.empty(w, device="meta")
    table = torch.empty(n, 1, d, device="meta")
    heads = hq + 2 * hkv
    qkv = plan_norm_qkv_rope(
        h, vec, vec, 1e-6, torch.empty(heads * d, w, **meta), hq + hkv, table, table,
        torch.empty(n, heads, d, **meta),
    )  # fmt: skip
    gate_up = plan_norm_gate_up(
        h, vec, vec, 1e-6, torch.empty(2 * hidden, w, **meta), torch.empty(n, hidden, **meta)
    )
    return [qkv, gate_up]
