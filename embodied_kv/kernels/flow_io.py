"""The action expert's fp32 in and out projections, each one kernel with what surrounds it
(issue 33 item 4's last part).

    action_in    h = (x_t @ W_in^T + b_in) in the model's dtype          [H, A] -> [H, W]
    euler_out    x' = x + dt * (xn.float() @ W_out^T + b_out)            [H, W] -> [H, A]

Both projections stay fp32 under the precision policy (model/precision.py, openpi's: the
flow state and its heads in fp32). On an H200 (2026-12-04 profile) cuBLAS ran each of these
[50, 32] x [32, 1024] and [50, 1024] x [1024, 32] fp32 GEMMs as `sgemm_largek` at ~14.5 us a
call, 20 a pi05 action, plus a cast kernel around each and the Euler step's multiply and
add: 6 kernels a step. Here: 2 a step, each a few programs of fp32 FMA dots.

The references are the model's torch code op for op (F.linear, the casts, `x + dt * v`): the
CPU runs them, so CPU bytes are unchanged. The kernels sum K in another order (fp32 rounding)
and may contract `x + dt * v` into one FMA.

Supported range: x_t / x fp32 [H, A] and xn [H, W] (16-bit or fp32) with contiguous last
dims; W_in [W, A], W_out [A, W] fp32 contiguous, biases fp32 [W] / [A].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

BLOCK_M = 16  # rows per program: pi05's 50 -> 4 row blocks
BLOCK_N = 32  # outputs per program: action_in 1024 -> 32 column blocks; euler_out's 32 -> 1
BLOCK_K = 128  # K per step: euler_out's 1024 in 8 steps, action_in's 32 in one


def action_in_ref(x_t: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dtype: torch.dtype):
    """x_t [H, A] -> (x_t @ w^T + b) in `dtype`: `action_in_proj(x_t.to(w.dtype)).to(dtype)`."""
    return as_dtype(F.linear(as_dtype(x_t, w.dtype), w, b), dtype)


def euler_out_ref(x, xn, w, b, dt: float) -> torch.Tensor:
    """x + dt * action_out_proj(xn.to(w.dtype)).float(), the Euler step of `sample`."""
    return x + dt * F.linear(as_dtype(xn, w.dtype), w, b).float()


if triton is not None:
    from embodied_kv.kernels.triton_base import dot, round_bf16

    @triton.jit
    def _flow_linear_fwd(
        a_ptr,  # [M, K] input rows, contiguous last dim
        w_ptr,  # [N, K] fp32 weight, contiguous
        b_ptr,  # [N] fp32 bias
        x_ptr,  # [M, N] fp32 flow state (read when EULER)
        out_ptr,  # [M, N] out: x + dt * y (EULER) or y in out's dtype
        m_rows,
        n_cols,
        k_dim,
        dt,
        stride_a,
        stride_x,
        stride_o,
        EULER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = rows < m_rows, cols < n_cols
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < k_dim
            a = tl.load(a_ptr + rows[:, None] * stride_a + kk[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[None, :] * k_dim + kk[:, None],
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
            acc = dot(a, w, acc, DOT_IN_FP32, "ieee")
        y = acc + tl.load(b_ptr + cols, mask=mask_n, other=0.0)[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if EULER:
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            y = x + dt * y
        else:
            y = round_bf16(y, ROUND_BF16)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def plan_flow_linear(a, w, b, out, x=None, dt: float = 0.0) -> Launch:
    """The one launch: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); `x` given: the Euler
    epilogue x + dt * y (fp32 out), else y cast to out's dtype."""
    m, k = a.shape
    n = w.shape[0]
    euler = x is not None
    state = x if euler else out  # read only by the Euler epilogue
    return Launch(
        name=f"flow_{'euler_out' if euler else 'action_in'} M={m} N={n} K={k} "
        f"{str(a.dtype).removeprefix('torch.')}->{str(out.dtype).removeprefix('torch.')}",
        kernel=_flow_linear_fwd,
        grid=(-(-m // BLOCK_M), -(-n // BLOCK_N)),
        args=(a, w, b, state, out, m, n, k, float(dt), a.stride(0), state.stride(0),
              out.stride(0)),  # fmt: skip
        constexprs={
            "EULER": euler,
            "BLOCK_M": BLOCK_M,
            "BLOCK_N": BLOCK_N,
            "BLOCK_K": min(BLOCK_K, pow2(k)),
            "ROUND_BF16": INTERPRETED and out.dtype == torch.bfloat16,
            "DOT_IN_FP32": INTERPRETED,
        },
        num_warps=4,
        num_stages=2,
    )


def _check(a, w, b, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"the {what} kernel needs triton, which is not installed")
    if a.dim() != 2 or w.dim() != 2 or w.shape[1] != a.shape[1] or b.shape != (w.shape[0],):
        raise ValueError(
            f"{what}: expected a [M, K], w [N, K], b [N]; got {tuple(a.shape)}, "
            f"{tuple(w.shape)}, {tuple(b.shape)}"
        )
    if w.dtype != torch.float32 or b.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError(f"{what}: the weight and bias must be contiguous fp32")
    if a.stride(-1) != 1:
        raise RuntimeError(f"{what} kernel: the input needs a contiguous last dim")


def action_in_kernel(x_t, w, b, dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    _check(x_t, w, b, "action_in")
    out = torch.empty(x_t.shape[0], w.shape[0], dtype=dtype, device=x_t.device)
    plan_flow_linear(x_t, w, b, out).run()
    return out


def euler_out_kernel(x, xn, w, b, dt: float) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    _check(xn, w, b, "euler_out")
    if x.shape != (xn.shape[0], w.shape[0]) or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"euler_out: x must be fp32 [{xn.shape[0]}, {w.shape[0]}], got "
                         f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    out = torch.empty_like(x)
    plan_flow_linear(xn, w, b, out, x, dt).run()
    return out


def fp32_head(a, w, b) -> bool:
    """The kernels' range besides the device: 2-D rows, a contiguous fp32 weight and bias (the
    precision policy keeps them so; a model built otherwise runs the references)."""
    fp32 = w.dtype == torch.float32 and b is not None and b.dtype == torch.float32
    return a.dim() == 2 and fp32 and w.is_contiguous()


def action_in(x_t, w, b, dtype: torch.dtype) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(x_t, w, b) and fp32_head(x_t, w, b) and x_t.dtype == torch.float32:
        out = try_kernel("action_in", action_in_kernel, x_t, w, b, dtype)
        if out is not None:
            return out
    return action_in_ref(x_t, w, b, dtype)


def euler_out(x, xn, w, b, dt: float) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere."""
    if use_kernel(xn, w, b) and fp32_head(xn, w, b) and x.dim() == 2 and x.dtype == torch.float32:
        out = try_kernel("euler_out", euler_out_kernel, x, xn, w, b, dt)
        if out is not None:
            return out
    return euler_out_ref(x, xn, w, b, dt)


def pi05_launches() -> list[Launch]:
    """Both launches at pi05 shapes (H 50, A 32, W 1024; bf16 expert) on meta tensors."""
    meta = {"device": "meta"}
    x = torch.empty(50, 32, **meta)
    xn = torch.empty(50, 1024, dtype=torch.bfloat16, **meta)
    return [
        plan_flow_linear(x, torch.empty(1024, 32, **meta), torch.empty(1024, **meta), xn),
        plan_flow_linear(xn, torch.empty(32, 1024, **meta), torch.empty(32, **meta), x, x, -0.1),
    ]
