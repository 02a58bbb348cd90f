"""A linear layer whose result is added to the residual stream through a gate, as one kernel:
out = h + gate * (x @ w.T), the action expert's o_proj and down_proj (pi0.5 adaRMS gating).

In torch this is a cuBLAS GEMM, then `torch.addcmul` reading the GEMM's output and h again:
two launches and an [N, W] round trip, twice per layer and Euler step (360 pairs per action
at pi05). Here the epilogue of the GEMM tile loads h and the gate and writes the sum.

At pi05 the GEMM is skinny: N = 50 action rows, W = 1024, K = 2048 (o_proj) or 4096
(down_proj), so it is bound by reading the weight once (4 / 8 MiB bf16). 64 x 64 output tiles
make only 16 programs on an H100's 132 SMs, so K is cut into SPLIT_K chunks read by separate
programs (split-K): each writes its fp32 partial tile to a workspace and bumps the tile's
arrival counter; the program that arrives last sums the SPLIT_K partials in split order
0, 1, ..., SPLIT_K - 1 (whichever program that is, the order and so the bytes are the same)
and runs the epilogue. It then resets the counter to 0, so a workspace is reusable and a
CUDA graph replays with no memset. No program waits on another (no spin), so any grid runs.

Rounding: as `linear_gated_residual_ref` on a GPU, F.linear then addcmul. The K products are
accumulated in fp32 and the sum rounded to the input dtype (F.linear's output), then
h + gate * that is computed in fp32 and rounded once to the dtype (addcmul's CUDA and CPU
kernels compute in fp32, checked bytewise on the CPU). Only the summation order differs.

The output is a new tensor, never h: a CUDA graph's static buffers (h is one) stay valid.

Supported range: x [N, K], w [W, K], h [N, W], gate [W], all one dtype (fp32, bf16, fp16),
contiguous last dims (any row strides; gate contiguous); N, W, K >= 1, int32 offsets
(SPLIT_K x N x W < 2**31). The CPU and autograd run `linear_gated_residual_ref`, today's
torch code, so CPU bytes are unchanged.

sm_90 (triton 3.9 offline compile, its ptxas; `pi05_launches`, bf16, tile 64x64x64, 4 warps,
3 stages, split_k 8): 80 registers, no spills, 48 KiB shared, wgmma, at K 2048 and 4096. The
PTX hands off as CUTLASS's semaphore does: partial stores, bar.sync, one thread's
atom.acq_rel.gpu, its result through shared memory and bar.sync, then ld.global.cg. Without a
GPU here that hand-off ran only under the interpreter (programs one after another): untimed and
unraced on a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.triton_base import (
    INTERPRETED,
    KERNEL_DTYPES,
    Launch,
    pow2,
    tl,
    triton,
    use_kernel,
)

TARGET_PROGRAMS = 128  # about one program per SM of an H100 (132 SMs)
MAX_SPLIT_K = 16
PI05_ROWS = 50  # action horizon: the expert's suffix rows
PI05_WIDTH = 1024  # expert width (Gemma 300M)
PI05_K = (2048, 4096)  # o_proj: 8 heads x 256; down_proj: MLP width


def linear_gated_residual_ref(
    h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """h [N, W] + gate [W] * (x [N, K] @ w [W, K].T) -> [N, W], h's dtype: the model's torch
    code (model/expert.py), byte for byte."""
    return torch.addcmul(h, F.linear(x, w), gate)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows of x per tile
    block_n: int  # output features (rows of w) per tile
    block_k: int  # K columns per dot
    split_k: int  # programs along K per tile; 1: no workspace, the epilogue runs directly
    num_warps: int = 4
    num_stages: int = 3


def gemm_config(n: int, width: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The configuration the dispatcher uses, from shapes alone.

    One M tile covers pi05's 50 rows (64, wgmma's height); then SPLIT_K, a power of two, is
    raised while the grid stays within TARGET_PROGRAMS and each split keeps a K block:
    pi05 (bf16) gets 1 x 32 tiles x 4 splits = 128 programs, 512 (o_proj) or 1024
    (down_proj) K columns each.

    Timed on an H200 (bench/kernel_sweep.py, 2026-12-04, pi05 bf16, 18 layers' weights from
    HBM in one graph): 32 x 128 tiles, split 4: o_proj 7.4 us, down_proj 9.5 us a call,
    against 12.1 / 14.3 us at 64 x 64, split 8 (the tiles before) and 11.0 / 10.7 us for
    cuBLAS + addcmul; split 16 lost at every tile. fp32 keeps 64 x 32 (ieee dots on CUDA
    cores)."""
    block_m = min(64, pow2(n))
    fp32 = dtype == torch.float32
    block_n = 64 if fp32 else 32
    block_k = 32 if fp32 else 128
    tiles = -(-n // block_m) * -(-width // block_n)
    k_blocks = -(-k // block_k)
    split = 1
    while 2 * split <= min(MAX_SPLIT_K, k_blocks) and 2 * split * tiles <= TARGET_PROGRAMS:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split)


def split_chunk(k: int, cfg: GemmConfig) -> int:
    """K columns per split: whole BLOCK_K blocks, the last split possibly shorter."""
    blocks = -(-k // cfg.block_k)
    return -(-blocks // cfg.split_k) * cfg.block_k


def workspace(n: int, width: int, cfg: GemmConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [SPLIT_K, N, W] fp32, counters [tiles] int32 zeros) for split-K launches;
    1-element stand-ins when SPLIT_K is 1 (the kernel then touches neither).

    Allocate once per shape and reuse (the kernel leaves the counters at 0): a fresh one is a
    memset launch. Calls sharing a workspace must run in order on one stream."""
    if cfg.split_k == 1:
        return torch.empty(1, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    tiles = -(-n // cfg.block_m) * -(-width // cfg.block_n)
    return (
        torch.empty(cfg.split_k, n, width, dtype=torch.float32, device=device),
        torch.zeros(tiles, dtype=torch.int32, device=device),
    )


if triton is not None:
    from embodied_kv.kernels.triton_base import dot, round_bf16

    @triton.jit
    def _gated_residual_store(
        acc,  # [BLOCK_M, BLOCK_N] fp32 x @ w.T of the tile
        h_ptr,  # [N, W] residual stream
        gate_ptr,  # [W] gate
        out_ptr,  # [N, W] contiguous output
        offs_m,  # [BLOCK_M] rows
        offs_n,  # [BLOCK_N] output features
        mask_m,  # [BLOCK_M] offs_m < N
        mask_n,  # [BLOCK_N] offs_n < W
        width,  # W
        stride_h,  # h stride over rows
        ROUND_LIN: tl.constexpr,  # round x @ w.T to the dtype first, as F.linear's output is
        ROUND_BF16: tl.constexpr,  # round to nearest even by hand (the interpreter truncates)
    ):
        if ROUND_LIN:
            acc = round_bf16(acc, ROUND_BF16).to(out_ptr.dtype.element_ty).to(tl.float32)
        mask = mask_m[:, None] & mask_n[None, :]
        h = tl.load(h_ptr + offs_m[:, None] * stride_h + offs_n[None, :], mask=mask, other=0.0)
        g = tl.load(gate_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y = round_bf16(h.to(tl.float32) + g[None, :] * acc, ROUND_BF16)
        tl.store(
            out_ptr + offs_m[:, None] * width + offs_n[None, :],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    def gated_residual_tile_fn(
        pid_m,  # row block
        pid_n,  # output feature block
        split,  # K split
        n_tiles_n,  # output feature blocks (the grid's second dimension)
        x_ptr,  # [N, K] input rows
        w_ptr,  # [W, K] nn.Linear weight
        h_ptr,  # [N, W] residual stream
        gate_ptr,  # [W] gate, h's dtype
        out_ptr,  # [N, W] contiguous output: h + gate * (x @ w.T)
        part_ptr,  # [SPLIT_K, N, W] fp32 partial products (SPLIT_K > 1 only)
        count_ptr,  # [tiles] int32 arrivals per output tile, 0 between launches (SPLIT_K > 1)
        n_rows,  # N
        width,  # W
        k_dim,  # K
        chunk,  # K columns per split, a multiple of BLOCK_K
        stride_x,  # x stride over rows (elements)
        stride_w,  # w stride over rows
        stride_h,  # h stride over rows
        BLOCK_M: tl.constexpr,  # rows per tile
        BLOCK_N: tl.constexpr,  # output features per tile
        BLOCK_K: tl.constexpr,  # K columns per dot
        SPLIT_K: tl.constexpr,  # programs along K per tile
        ROUND_LIN: tl.constexpr,  # 16-bit dtype: x @ w.T rounded to it before the epilogue
        ROUND_BF16: tl.constexpr,  # interpreter and bf16: see round_bf16
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (cuBLAS's fp32 default)
    ):
        # Grid (cdiv(N, BLOCK_M), cdiv(W, BLOCK_N), SPLIT_K): program (m, n, s) owns output
        # tile (m, n) and K columns [s * chunk, min((s + 1) * chunk, K)).
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < n_rows
        mask_n = offs_n < width
        start = split * chunk
        end = tl.minimum(start + chunk, k_dim)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            ks = k0 + offs_k
            mask_k = ks < end
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_x + ks[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            b = tl.load(
                w_ptr + offs_n[None, :] * stride_w + ks[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]: w.T
            acc = dot(a, b, acc, DOT_IN_FP32, INPUT_PRECISION)
        if SPLIT_K == 1:
            _gated_residual_store(
                acc, h_ptr, gate_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, width,
                stride_h, ROUND_LIN, ROUND_BF16,
            )  # fmt: skip
        else:
            tile_offs = offs_m[:, None] * width + offs_n[None, :]
            mask = mask_m[:, None] & mask_n[None, :]
            tl.store(part_ptr + split * n_rows * width + tile_offs, acc, mask=mask)
            # every thread's partial stored before the one atomic releases them (gpu scope);
            # the atomic's acquire and the barrier that hands out its result order the loads
            tl.debug_barrier()
            tile = pid_m * n_tiles_n + pid_n
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                # fixed order: deterministic bytes. A loop, not static_range: unrolled, the
                # SPLIT_K tile loads were all hoisted (sm_90: 255 registers, 96 B spills; 80 as
                # a loop, offline_compile's ptxas)
                for s in range(SPLIT_K):
                    total += tl.load(
                        part_ptr + s * n_rows * width + tile_offs,
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",  # from L2, where the other SMs' stores are
                    )
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
                _gated_residual_store(
                    total, h_ptr, gate_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, width,
                    stride_h, ROUND_LIN, ROUND_BF16,
                )  # fmt: skip

    # the kernel's body: inlined in its kernel, a call in a persistent kernel's loop
    gated_residual_tile = triton.jit(gated_residual_tile_fn)
    gated_residual_tile_call = triton.jit(noinline=True)(gated_residual_tile_fn)

    @triton.jit
    def _linear_gated_residual_fwd(
        x_ptr,  # [N, K] input rows
        w_ptr,  # [W, K] nn.Linear weight
        h_ptr,  # [N, W] residual stream
        gate_ptr,  # [W] gate, h's dtype
        out_ptr,  # [N, W] contiguous output: h + gate * (x @ w.T)
        part_ptr,  # [SPLIT_K, N, W] fp32 partial products (SPLIT_K > 1 only)
        count_ptr,  # [tiles] int32 arrivals per output tile, 0 between launches (SPLIT_K > 1)
        n_rows,  # N
        width,  # W
        k_dim,  # K
        chunk,  # K columns per split, a multiple of BLOCK_K
        stride_x,  # x stride over rows (elements)
        stride_w,  # w stride over rows
        stride_h,  # h stride over rows
        BLOCK_M: tl.constexpr,  # rows per tile
        BLOCK_N: tl.constexpr,  # output features per tile
        BLOCK_K: tl.constexpr,  # K columns per dot
        SPLIT_K: tl.constexpr,  # programs along K per tile
        ROUND_LIN: tl.constexpr,  # 16-bit dtype: x @ w.T rounded to it before the epilogue
        ROUND_BF16: tl.constexpr,  # interpreter and bf16: see round_bf16
        DOT_IN_FP32: tl.constexpr,  # interpreter only, see triton_base.dot
        INPUT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (cuBLAS's fp32 default)
    ):
        gated_residual_tile(
            tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), x_ptr,
            w_ptr, h_ptr, gate_ptr, out_ptr, part_ptr,
            count_ptr, n_rows, width, k_dim, chunk, stride_x, stride_w, stride_h,
            BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, ROUND_LIN, ROUND_BF16, DOT_IN_FP32,
            INPUT_PRECISION,
        )  # fmt: skip


def plan_linear_gated_residual(
    h: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
    cfg: GemmConfig | None = None,
) -> list[Launch]:
    """The one launch (inputs already validated; `meta` tensors work). `work`: a
    `workspace(N, W, cfg, device)`, allocated here if None; `cfg`: `gemm_config`'s if None."""
    n, k = x.shape
    width = w.shape[0]
    cfg = gemm_config(n, width, k, x.dtype) if cfg is None else cfg
    part, count = workspace(n, width, cfg, x.device) if work is None else work
    fp32 = x.dtype == torch.float32
    tag = (
        f"{str(x.dtype).removeprefix('torch.')} N={n} W={width} K={k} "
        f"tile={cfg.block_m}x{cfg.block_n}x{cfg.block_k} split_k={cfg.split_k}"
    )
    args = (
        x, w, h, gate, out, part, count, n, width, k, split_chunk(k, cfg),
        x.stride(0), w.stride(0), h.stride(0),
    )  # fmt: skip
    launch = Launch(
        name=f"linear_gated_residual {tag}",
        kernel=_linear_gated_residual_fwd,
        grid=(-(-n // cfg.block_m), -(-width // cfg.block_n), cfg.split_k),
        args=args,
        constexprs={
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k,
            "SPLIT_K": cfg.split_k,
            "ROUND_LIN": not fp32,
            "ROUND_BF16": INTERPRETED and x.dtype == torch.bfloat16,
            "DOT_IN_FP32": INTERPRETED,
            "INPUT_PRECISION": "ieee" if fp32 else "tf32",
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return [launch]


def pi05_launches() -> list[Launch]:
    """The launches at pi05 shapes (meta tensors, bf16): o_proj (K 2048) and down_proj
    (K 4096) of the action expert, 50 rows, W 1024; for kernels/offline_compile.py."""
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    h = torch.empty(PI05_ROWS, PI05_WIDTH, **meta)
    gate = torch.empty(PI05_WIDTH, **meta)
    launches = []
    for k in PI05_K:
        x = torch.empty(PI05_ROWS, k, **meta)
        w = torch.empty(PI05_WIDTH, k, **meta)
        launches += plan_linear_gated_residual(h, x, w, gate, torch.empty_like(h))
    return launches


def _check(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor) -> None:
    """ValueError for shapes or dtypes the op does not define; RuntimeError for layouts the
    kernel does not take."""
    if x.dim() != 2 or w.dim() != 2 or h.dim() != 2 or gate.dim() != 1:
        raise ValueError(
            f"expected h [N, W], x [N, K], w [W, K], gate [W]; got h {tuple(h.shape)}, "
            f"x {tuple(x.shape)}, w {tuple(w.shape)}, gate {tuple(gate.shape)}"
        )
    (n, k), width = x.shape, w.shape[0]
    if w.shape[1] != k or h.shape != (n, width) or gate.shape[0] != width or 0 in (n, k, width):
        raise ValueError(
            f"shapes disagree (or are empty): h {tuple(h.shape)}, x {tuple(x.shape)}, "
            f"w {tuple(w.shape)}, gate {tuple(gate.shape)}"
        )
    dtypes = {t.dtype for t in (h, x, w, gate)}
    if len(dtypes) != 1 or x.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"h, x, w and gate must share one dtype of {KERNEL_DTYPES}; got h {h.dtype}, "
            f"x {x.dtype}, w {w.dtype}, gate {gate.dtype}"
        )
    if any(t.stride(-1) != 1 for t in (h, x, w, gate)):
        raise RuntimeError(
            "linear_gated_residual kernel: h, x, w and gate need a contiguous last dim; got "
            f"strides h {h.stride()}, x {x.stride()}, w {w.stride()}, gate {gate.stride()}"
        )


def linear_gated_residual_kernel(
    h: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    gate: torch.Tensor,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
    cfg: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1) -> a new [N, W]."""
    if triton is None:
        raise RuntimeError("the gated-residual GEMM kernel needs triton, which is not installed")
    _check(h, x, w, gate)
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    for launch in plan_linear_gated_residual(h, x, w, gate, out, work, cfg):
        launch.run()
    return out


def linear_gated_residual(
    h: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    gate: torch.Tensor,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA at inference, the reference elsewhere. `work`: a
    `workspace(N, W, gemm_config(N, W, K, dtype), device)` kept by the caller (else one is
    allocated per call)."""
    if use_kernel(h, x, w, gate):
        out = try_kernel("linear_gated_residual", linear_gated_residual_kernel, h, x, w, gate, work)
        if out is not None:
            return out
    return linear_gated_residual_ref(h, x, w, gate)
