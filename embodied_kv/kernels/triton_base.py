"""What the packed-attention Triton kernels share: the import guard, interpreter detection,
the online-softmax block step, and `Launch`, the record of one kernel launch.

A `Launch` is planned from shapes alone (it runs on `meta` tensors), so the configurations
the dispatcher picks are the ones `kernels/offline_compile.py` compiles for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference; the kernel wrapper says why it can't
    triton = None
    tl = None

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # pi0.5 (Gemma 2B) head_dim
MAX_GROUP = 32  # query heads per kv head; bounds the per-program fp32 accumulator
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on NVIDIA GPUs
LOG2E = 1.4426950408889634  # scores live in the exp2 domain: exp(x) = exp2(x * log2(e))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`: t itself when it already is. The CPU references run dozens of casts per
    decode step and a no-op `.to` still goes through the dispatcher (~0.7 us here)."""
    return t if t.dtype == dtype else t.to(dtype)


def pow2(n: int, at_least: int = MIN_DOT) -> int:
    """Smallest power of two >= max(n, at_least)."""
    return max(at_least, 1 << (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def dot(a, b, acc, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        # The interpreter multiplies bf16 tiles as raw uint16 (triton 3.9), so it upcasts first.
        # 16-bit products are exact in fp32, so this matches the tensor-core result up to
        # summation order.
        if DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        return acc

    @triton.jit
    def load_kv_block(
        k_base,  # pointer to row 0 of one slot and KV head of the keys
        v_base,  # the same for the values
        rows,  # [BLOCK_N] row indices
        n_rows,  # rows >= n_rows load as 0
        offs_d,  # [BLOCK_D] arange
        mask_d,  # [BLOCK_D] offs_d < HEAD_DIM
        stride_kt,  # k stride over rows
        stride_vt,  # v stride over rows
    ):
        """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of `rows`. The masked loads also keep
        garbage (even NaN) past a slot's valid rows out of both products."""
        mask_n = rows < n_rows
        k = tl.load(
            k_base + rows[None, :] * stride_kt + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + rows[:, None] * stride_vt + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        return k, v

    @triton.jit
    def attend_block(
        q,  # [R, BLOCK_D] queries, input dtype
        k,  # [BLOCK_D, BLOCK_N] keys, zeros where masked
        v,  # [BLOCK_N, BLOCK_D] values, zeros where masked
        valid,  # [R, BLOCK_N] or [1, BLOCK_N] bool: which scores count
        m_i,  # [R] fp32 running max (exp2 domain)
        l_i,  # [R] fp32 running softmax denominator
        acc,  # [R, BLOCK_D] fp32 running unnormalised output
        qk_scale,  # softmax scale * log2(e)
        SPLIT_P: tl.constexpr,  # 16-bit inputs: P @ V as hi + lo halves, see below
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32 rounding)
    ):
        """One online-softmax (flash-attention) step over BLOCK_N keys. A block with no valid
        key for a row leaves that row's state bit-identical: m_i = -inf, l_i = 0, acc = 0 while
        a row has seen none (a split of the expert's prefix may hold only masked rows)."""
        zeros = tl.zeros([q.shape[0], k.shape[1]], dtype=tl.float32)
        scores = dot(q, k, zeros, DOT_IN_FP32, INPUT_PRECISION) * qk_scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # no key yet: subtract 0, not -inf (-inf - -inf is NaN); a finite m_new is unchanged
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(scores - m_sub[:, None])  # [R, BLOCK_N] fp32
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if SPLIT_P:
            # The reference keeps P in fp32. Rounding P to bf16 once cost, before the output
            # rounding, 1.3x the reference's whole bf16 error (D = 256, interpreter);
            # hi + lo carries ~16 bits for one extra MMA, free in this memory-bound loop.
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = dot(p_hi, v, acc, DOT_IN_FP32, INPUT_PRECISION)
            acc = dot(p_lo, v, acc, DOT_IN_FP32, INPUT_PRECISION)
        else:
            acc = dot(p.to(v.dtype), v, acc, DOT_IN_FP32, INPUT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def round_bf16(y, ROUND_BF16: tl.constexpr):
        """fp32 y rounded to the nearest even bf16 value (still fp32) when ROUND_BF16: triton
        3.9's interpreter casts fp32 -> bf16 by truncation, the GPU rounds to nearest even;
        after this the interpreter's truncation is exact. Elementwise kernels store through it."""
        if ROUND_BF16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
        return y

    # Decorated under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests).
    INTERPRETED = not isinstance(dot, triton.runtime.JITFunction)
else:
    INTERPRETED = False


def use_kernel(*tensors: torch.Tensor | None) -> bool:
    """The dispatch rule of every fused op: its Triton kernel on CUDA at inference, its torch
    reference on a CPU and wherever autograd records (the kernels have no backward: training
    on CUDA runs the references)."""
    x = tensors[0]
    if not x.is_cuda:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def precision_flags(dtype: torch.dtype) -> dict[str, object]:
    """The numeric constexprs every attention kernel here takes, for inputs of `dtype`."""
    fp32 = dtype == torch.float32
    return {
        "SPLIT_P": not fp32,
        "DOT_IN_FP32": INTERPRETED,
        "INPUT_PRECISION": "ieee" if fp32 else "tf32",
    }


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **constexprs, num_warps=, num_stages=)`.

    `args` are the runtime arguments in the kernel's order (tensors, ints, floats);
    `name` says which configuration this is, for reports."""

    name: str
    kernel: Any  # a triton.jit function
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    def run(self) -> None:
        self.kernel[self.grid](
            *self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages
        )
