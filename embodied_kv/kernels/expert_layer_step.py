"""The action expert's whole layer-step as one persistent launch, and every layer of an
Euler step as one (issue 33 item 1, its second stage): the five kernels of
model/expert_step.py's fused path as the items of one work queue (kernels/work_queue.py), in
dependency order, layer after layer:

    phase 0  norm -> q/k/v + RoPE     kernels/norm_qkv_rope.py's programs (each waits for
                                      the layer before's phase 5)
    phase 1  the attention's splits   kernels/expert_tile.py (each waits for phase 0)
    phase 2  their reduce             kernels/expert_combine.py (each waits for its tile)
    phase 3  o_proj + gated residual  kernels/gemm_residual.py's split-K programs (phase 2)
    phase 4  norm -> gate/up + GELU   kernels/norm_gate_up.py's programs (phase 3)
    phase 5  down + gated residual    kernels/gemm_residual.py's split-K programs (phase 4)

A program per SM takes items in that order; an item waits only for the phase before it
(whole phases: each GEMM reads whole rows or whole heads), so there is no launch boundary:
where five launches a layer each ramped up and drained, the next phase's items start on
the SMs the last one frees. Each item is its kernel's body, called (not inlined: inlined in
one loop their invariants were hoisted across every phase), so the bytes are the five
kernels' (tested under the interpreter, where program 0 takes every item in order).

Several layers (a LayerTable): layer l's items read its weights at element offsets from
layer 0's (a device table, the model's own tensors: nothing restacked), its modulation, K/V
and mask at equal strides from layer 0's; the stream passes between layers through two
[N, W] buffers. The phase counters count across layers (layer l's phase p is done at
(l + 1) x its items), so one launch serves an Euler step's 18 layers: 10 a denoise.

Counters (int32, 0 between launches): the attention's per tile (expert_workspace), the two
split-K GEMMs' per tile (gemm_residual.workspace), and PHASE_WORDS here: arrivals of phases
0, 2, 3, 4 and 5, the queue's next item and its error flag (`failed`).

Untimed on a GPU: `bench latency`'s graphs_alt runs the fused path (FUSED_LAYER_STEP is
False: an H200 timed the five kernels' path 1.28 ms slower than the chain), now one launch
an Euler step (model/expert.py PERSISTENT_EULER_STEP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied_kv.kernels import gemm_residual as res
from embodied_kv.kernels.expert_attention import chunk_blocks, expert_workspace, split_count
from embodied_kv.kernels.expert_combine import QUEUE_COLS, reduce_items
from embodied_kv.kernels.fallback import try_kernel
from embodied_kv.kernels.l2_prefetch import chunk_bytes, kernel_mode
from embodied_kv.kernels.layer_table import OFFSET_BYTES, LayerTable
from embodied_kv.kernels.norm_gate_up import plan_norm_gate_up
from embodied_kv.kernels.norm_prologue import PI05_EXPERT, numerics
from embodied_kv.kernels.norm_qkv_rope import plan_norm_qkv_rope
from embodied_kv.kernels.prefill_tile import tile_config, tile_constexprs
from embodied_kv.kernels.triton_base import LOG2E, Launch, pow2, tl, triton, use_kernel
from embodied_kv.kernels.work_queue import MAX_SPINS, QUEUE_WORDS, programs

PHASE_WORDS = 5 + QUEUE_WORDS  # arrivals of phases 0, 2, 3, 4, 5; the queue's two words
# programs a SM (work_queue.programs): one program of 4 warps a SM streams the GEMM phases'
# weights with few loads in flight; two fit at once at sm_90 (249 registers x 128 threads,
# 82 KiB of shared memory each). Untimed: bench/kernel_sweep's layer_step row times both
PROGRAMS_PER_SM = 1


@dataclass
class StepWork:
    """A layer-step's buffers, reused by every layer and call of one shape (stream order):
    q/k/v, the attention's workspace and output, h after the attention, the MLP's
    activation, the two GEMMs' split-K workspaces, the phase counters."""

    qkv: torch.Tensor  # [N, Hq + 2 Hkv, D]
    attention: tuple[torch.Tensor, ...]  # expert_workspace
    attn_out: torch.Tensor  # [N, Hq, D]
    h1: torch.Tensor  # [N, W]
    act: torch.Tensor  # [N, F]
    o_work: tuple[torch.Tensor, torch.Tensor]
    down_work: tuple[torch.Tensor, torch.Tensor]
    phases: torch.Tensor  # int32 [PHASE_WORDS]
    hs: torch.Tensor  # [2, N, W]: the stream between the layers of a multi-layer launch
    one_layer: torch.Tensor  # int64 [4] zeros: a one-layer launch's weight offsets

    @classmethod
    def new(cls, h, w_qkv, w_o, w_down, heads: tuple[int, int, int], n_prefix: int):
        (n, width), (hq, hkv, d), f = h.shape, heads, w_down.shape[1]
        like = {"dtype": h.dtype, "device": h.device}
        o_cfg = res.gemm_config(n, width, hq * d, h.dtype)
        down_cfg = res.gemm_config(n, width, f, h.dtype)
        return cls(
            torch.empty(n, hq + 2 * hkv, d, **like),
            expert_workspace(n, hq, hkv, d, n_prefix, h.dtype, h.device),
            torch.empty(n, hq, d, **like),
            torch.empty(n, width, **like),
            torch.empty(n, f, **like),
            res.workspace(n, width, o_cfg, h.device),
            res.workspace(n, width, down_cfg, h.device),
            torch.zeros(PHASE_WORDS, dtype=torch.int32, device=h.device),
            torch.empty(2, n, width, **like),
            torch.zeros(4, dtype=torch.int64, device=h.device),
        )


def one_layer(work: StepWork) -> LayerTable:
    return LayerTable(1, work.one_layer)


def failed(work: StepWork) -> bool:
    """A wait of a launch on this workspace ran past its bound (reads the device)."""
    return bool(work.phases[-1].item())


if triton is not None:
    from embodied_kv.kernels.expert_combine import reduce_item
    from embodied_kv.kernels.expert_tile import attend_tile_call
    from embodied_kv.kernels.gemm_residual import gated_residual_tile_call
    from embodied_kv.kernels.l2_prefetch import prefetch_share
    from embodied_kv.kernels.norm_gate_up import norm_gate_up_tile_call
    from embodied_kv.kernels.norm_qkv_rope import norm_qkv_rope_tile_call
    from embodied_kv.kernels.work_queue import arrive, finish, grab, wait_for

    @triton.jit
    def _expert_layer_step_fwd(
        # phase 0: h [N, W] -> qkv [N, heads, D] (norm_qkv_rope's arguments)
        scale_a_ptr, shift_a_ptr, w_qkv_ptr, cos_ptr, sin_ptr, qkv_ptr, n_rows, width,
        rope_heads, eps_a, stride_h, stride_wqkv, stride_c, stride_qkv, qkv_cols,
        # phases 1, 2: the attention over the slot's prefix rows (expert_attention's)
        kp_ptr, vp_ptr, bias_ptr, m_ptr, l_ptr, acc_ptr, att_count_ptr, att_out_ptr,
        n_prefix, chunk, qk_scale, n_heads, stride_kpt, stride_kph, stride_vpt, stride_vph,
        # phase 3: h1 = h + gate_a * (att_out @ w_o.T) (gemm_residual's)
        w_o_ptr, gate_a_ptr, h1_ptr, part_o_ptr, count_o_ptr, k_o, chunk_o, stride_wo,
        # phase 4: act = gelu(norm(h1) @ w_gate.T) * (norm(h1) @ w_up.T) (norm_gate_up's)
        scale_b_ptr, shift_b_ptr, w_gu_ptr, act_ptr, hidden, eps_b, stride_wgu,
        # phase 5: out = h1 + gate_b * (act @ w_down.T)
        w_d_ptr, gate_b_ptr, part_d_ptr, count_d_ptr, chunk_d, stride_wd,
        # layers: L; each weight's element offset from layer 0's (int64 [4, L]); the
        # strides from a layer's modulation / K,V / mask to the next's; the residual stream
        # between layers in hs [2, N, W], h and out at element offsets from it
        n_layers, w_off_ptr, stride_sc, stride_sh, stride_g, stride_kvl, stride_bl, hs_ptr,
        in_off, out_off,
        phase_ptr, max_spins,
        QKV_BLOCK_M: tl.constexpr, QKV_BLOCK_H: tl.constexpr, QKV_BLOCK_K: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SPLIT_P: tl.constexpr, REDUCE_ITEMS: tl.constexpr,
        QUEUE_COLS: tl.constexpr,
        O_BLOCK_M: tl.constexpr, O_BLOCK_N: tl.constexpr, O_BLOCK_K: tl.constexpr,
        O_SPLIT_K: tl.constexpr,
        GU_BLOCK_M: tl.constexpr, GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr,
        D_BLOCK_M: tl.constexpr, D_BLOCK_N: tl.constexpr, D_BLOCK_K: tl.constexpr,
        D_SPLIT_K: tl.constexpr,
        ROUND_LIN: tl.constexpr, ROUND_BF16: tl.constexpr, DOT_IN_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, OFF_GRAIN: tl.constexpr, PREFETCH: tl.constexpr,
        PF_CHUNK: tl.constexpr,
    ):  # fmt: skip
        hq = n_heads
        n_kv = n_heads // GROUP
        # item counts per phase, from the same shapes the five launches' grids come from
        qkv_p = qkv_cols  # column programs of phase 0 (one per row block)
        e0 = tl.cdiv(n_rows, QKV_BLOCK_M) * qkv_p
        n_tiles = tl.cdiv(n_rows, BLOCK_M) * n_kv
        e1 = e0 + n_tiles * NUM_SPLITS
        e2 = e1 + n_tiles * REDUCE_ITEMS
        o_n = tl.cdiv(width, O_BLOCK_N)
        e3 = e2 + tl.cdiv(n_rows, O_BLOCK_M) * o_n * O_SPLIT_K
        gu_c = tl.cdiv(hidden, GU_BLOCK_N)
        e4 = e3 + tl.cdiv(n_rows, GU_BLOCK_M) * gu_c
        d_n = tl.cdiv(width, D_BLOCK_N)
        e5 = e4 + tl.cdiv(n_rows, D_BLOCK_M) * d_n * D_SPLIT_K
        queue_ptr = phase_ptr + 5
        err_ptr = queue_ptr + 1
        nw = n_rows * width
        es = w_qkv_ptr.dtype.element_ty.primitive_bitwidth // 8
        item = grab(queue_ptr)
        while item < n_layers * e5:
            layer = item // e5
            local = item - layer * e5
            # this layer's tensors: its input and output stream, modulation, K/V, mask
            h_l = hs_ptr + tl.where(layer == 0, in_off, ((layer + 1) % 2) * nw)
            out_l = hs_ptr + tl.where(layer == n_layers - 1, out_off, (layer % 2) * nw)
            if local < e0:
                w_l = w_qkv_ptr + tl.multiple_of(tl.load(w_off_ptr + layer), OFF_GRAIN)
                # each item its share of the phase's weights towards L2 before it waits
                # (kernels/l2_prefetch.py; off under the interpreter), as in phases 3-5
                prefetch_share(w_l, (rope_heads + n_kv) * HEAD_DIM * stride_wqkv * es, local,
                               e0, PREFETCH, PF_CHUNK)  # fmt: skip
                if layer > 0:  # the layer before has written its output
                    wait_for(phase_ptr + 4, layer * (e5 - e4), err_ptr, max_spins)
                norm_qkv_rope_tile_call(
                    local // qkv_p, local % qkv_p, h_l, scale_a_ptr + layer * stride_sc,
                    shift_a_ptr + layer * stride_sh, w_l, cos_ptr, sin_ptr, qkv_ptr, n_rows,
                    width, rope_heads, eps_a, stride_h, stride_wqkv, stride_c, stride_qkv,
                    HEAD_DIM, QKV_BLOCK_M, QKV_BLOCK_H, QKV_BLOCK_K, ROUND_BF16, DOT_IN_FP32,
                    INPUT_PRECISION,
                )  # fmt: skip
                arrive(phase_ptr)
            elif local < e1:
                wait_for(phase_ptr, (layer + 1) * e0, err_ptr, max_spins)
                tk = (local - e0) // NUM_SPLITS
                attend_tile_call(
                    tk // n_kv, tk % n_kv, (local - e0) % NUM_SPLITS, qkv_ptr,
                    kp_ptr + layer * stride_kvl, vp_ptr + layer * stride_kvl,
                    qkv_ptr + hq * HEAD_DIM, qkv_ptr + (hq + n_kv) * HEAD_DIM,
                    bias_ptr + layer * stride_bl, m_ptr, l_ptr, acc_ptr, bias_ptr, bias_ptr, 0,
                    qkv_ptr, 0, HEAD_DIM, n_rows, n_prefix, chunk, qk_scale, n_heads,
                    stride_qkv, HEAD_DIM, stride_kpt, stride_kph, stride_vpt, stride_vph,
                    stride_qkv, HEAD_DIM, stride_qkv, HEAD_DIM, GROUP, GROUP_PAD, BLOCK_M,
                    HEAD_DIM, BLOCK_D, BLOCK_N, NUM_SPLITS, SPLIT_P, DOT_IN_FP32,
                    INPUT_PRECISION, False, False, ROUND_BF16,
                )  # fmt: skip
                arrive(att_count_ptr + tk)
            elif local < e2:
                reduce_item(
                    m_ptr, l_ptr, acc_ptr, att_out_ptr, att_count_ptr,
                    (local - e1) // REDUCE_ITEMS, (local - e1) % REDUCE_ITEMS, n_tiles, n_kv,
                    n_rows, n_heads, hq * HEAD_DIM, HEAD_DIM, err_ptr, max_spins, GROUP,
                    GROUP_PAD, BLOCK_M, HEAD_DIM, NUM_SPLITS, REDUCE_ITEMS, QUEUE_COLS,
                )  # fmt: skip
                arrive(phase_ptr + 1)
            elif local < e3:
                i = local - e2
                w_l = w_o_ptr + tl.multiple_of(tl.load(w_off_ptr + n_layers + layer), OFF_GRAIN)
                prefetch_share(w_l, width * stride_wo * es, i, e3 - e2, PREFETCH, PF_CHUNK)
                wait_for(phase_ptr + 1, (layer + 1) * (e2 - e1), err_ptr, max_spins)
                gated_residual_tile_call(
                    i // (o_n * O_SPLIT_K), (i // O_SPLIT_K) % o_n, i % O_SPLIT_K, o_n,
                    att_out_ptr, w_l, h_l, gate_a_ptr + layer * stride_g, h1_ptr, part_o_ptr,
                    count_o_ptr, n_rows, width, k_o, chunk_o, hq * HEAD_DIM, stride_wo,
                    stride_h, O_BLOCK_M, O_BLOCK_N, O_BLOCK_K, O_SPLIT_K, ROUND_LIN,
                    ROUND_BF16, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
                arrive(phase_ptr + 2)
            elif local < e4:
                w_l = w_gu_ptr + tl.multiple_of(tl.load(w_off_ptr + 2 * n_layers + layer),
                                                OFF_GRAIN)
                prefetch_share(w_l, 2 * hidden * stride_wgu * es, local - e3, e4 - e3, PREFETCH,
                               PF_CHUNK)  # fmt: skip
                wait_for(phase_ptr + 2, (layer + 1) * (e3 - e2), err_ptr, max_spins)
                norm_gate_up_tile_call(
                    (local - e3) // gu_c, (local - e3) % gu_c, h1_ptr,
                    scale_b_ptr + layer * stride_sc, shift_b_ptr + layer * stride_sh, w_l,
                    act_ptr, n_rows, width, hidden, eps_b, width, stride_wgu, GU_BLOCK_M,
                    GU_BLOCK_N, GU_BLOCK_K, ROUND_BF16, DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
                arrive(phase_ptr + 3)
            else:
                i = local - e4
                w_l = w_d_ptr + tl.multiple_of(tl.load(w_off_ptr + 3 * n_layers + layer),
                                               OFF_GRAIN)
                prefetch_share(w_l, width * stride_wd * es, i, e5 - e4, PREFETCH, PF_CHUNK)
                wait_for(phase_ptr + 3, (layer + 1) * (e4 - e3), err_ptr, max_spins)
                gated_residual_tile_call(
                    i // (d_n * D_SPLIT_K), (i // D_SPLIT_K) % d_n, i % D_SPLIT_K, d_n,
                    act_ptr, w_l, h1_ptr, gate_b_ptr + layer * stride_g, out_l, part_d_ptr,
                    count_d_ptr, n_rows, width, hidden, chunk_d, hidden, stride_wd, width,
                    D_BLOCK_M, D_BLOCK_N, D_BLOCK_K, D_SPLIT_K, ROUND_LIN, ROUND_BF16,
                    DOT_IN_FP32, INPUT_PRECISION,
                )  # fmt: skip
                arrive(phase_ptr + 4)
            item = grab(queue_ptr)
        finish(queue_ptr, item, n_layers * e5, phase_ptr, 5)  # phase counters and the queue


def plan_layer_step(h, scale1, shift, eps, gate, w_qkv, heads, cos, sin, kp, vp, bias,
                    scale: float, w_o, w_gu, w_down, work: StepWork, out,
                    max_spins: int = MAX_SPINS, table: LayerTable | None = None,
                    prefetch: bool = True, per_sm: int | None = None) -> Launch:  # fmt: skip
    """The one launch (inputs already validated; `meta` tensors work). scale1, shift, eps,
    gate: pairs (the input norm and the gate after the attention, the post-attention norm
    and the gate after the MLP); heads (Hq, Hkv, D). The tensors are layer 0's; `table`
    (layer_table) runs its layers one after another in the launch, out the last one's.
    `per_sm`: programs a SM (None: PROGRAMS_PER_SM)."""
    table = table or one_layer(work)
    pf_mode = kernel_mode(h.device, prefetch)  # none under the interpreter
    (n, width), (hq, hkv, d), hidden = h.shape, heads, w_down.shape[1]
    qkv = plan_norm_qkv_rope(h, scale1[0], shift[0], eps[0], w_qkv, hq + hkv, cos, sin, work.qkv)
    gu = plan_norm_gate_up(work.h1, scale1[1], shift[1], eps[1], w_gu, work.act)
    cfg = tile_config(h.dtype, hq // hkv)
    n_p = kp.shape[0]
    splits = split_count(n_p, cfg.block_n)
    o_cfg = res.gemm_config(n, width, hq * d, h.dtype)
    d_cfg = res.gemm_config(n, width, hidden, h.dtype)
    tiles = -(-n // cfg.block_m) * hkv
    items = (qkv.grid[0] * qkv.grid[1] + tiles * (splits + reduce_items(pow2(d)))
             + -(-n // o_cfg.block_m) * -(-width // o_cfg.block_n) * o_cfg.split_k
             + gu.grid[0] * gu.grid[1]
             + -(-n // d_cfg.block_m) * -(-width // d_cfg.block_n) * d_cfg.split_k)  # fmt: skip
    m, l_s, acc, att_count = work.attention
    es = h.element_size()
    args = (
        scale1[0], shift[0], w_qkv, cos, sin, work.qkv, n, width, hq + hkv, eps[0],
        h.stride(0), w_qkv.stride(0), cos.stride(0), work.qkv.stride(0), qkv.grid[1],
        kp, vp, bias, m, l_s, acc, att_count, work.attn_out, n_p,
        chunk_blocks(n_p, cfg.block_n, splits) * cfg.block_n, scale * LOG2E, hq,
        kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1),
        w_o, gate[0], work.h1, *work.o_work, hq * d, res.split_chunk(hq * d, o_cfg),
        w_o.stride(0),
        scale1[1], shift[1], w_gu, work.act, hidden, eps[1], w_gu.stride(0),
        w_down, gate[1], *work.down_work, res.split_chunk(hidden, d_cfg), w_down.stride(0),
        table.layers, table.offsets, *table.stride_mod, table.stride_kv, table.stride_bias,
        work.hs, (h.data_ptr() - work.hs.data_ptr()) // es,
        (out.data_ptr() - work.hs.data_ptr()) // es, work.phases, max_spins,
    )  # fmt: skip
    flags = numerics(h.dtype)
    return Launch(
        name=f"expert_layer_step {str(h.dtype).removeprefix('torch.')} N={n} W={width} "
        f"heads={hq}/{hkv} D={d} F={hidden} splits={splits} layers={table.layers}",
        kernel=_expert_layer_step_fwd,
        grid=(programs(items * table.layers, h.device, per_sm or PROGRAMS_PER_SM),),
        args=args,
        constexprs={
            "QKV_BLOCK_M": qkv.constexprs["BLOCK_M"],
            "QKV_BLOCK_H": qkv.constexprs["BLOCK_H"],
            "QKV_BLOCK_K": qkv.constexprs["BLOCK_K"],
            **tile_constexprs(cfg, hq // hkv, d, h.dtype),
            "NUM_SPLITS": splits,
            "REDUCE_ITEMS": reduce_items(pow2(d)),
            "QUEUE_COLS": QUEUE_COLS,
            "O_BLOCK_M": o_cfg.block_m, "O_BLOCK_N": o_cfg.block_n,
            "O_BLOCK_K": o_cfg.block_k, "O_SPLIT_K": o_cfg.split_k,
            "GU_BLOCK_M": gu.constexprs["BLOCK_M"], "GU_BLOCK_N": gu.constexprs["BLOCK_N"],
            "GU_BLOCK_K": gu.constexprs["BLOCK_K"],
            "D_BLOCK_M": d_cfg.block_m, "D_BLOCK_N": d_cfg.block_n,
            "D_BLOCK_K": d_cfg.block_k, "D_SPLIT_K": d_cfg.split_k,
            "ROUND_LIN": h.dtype != torch.float32,
            "ROUND_BF16": flags["ROUND_BF16"],
            "OFF_GRAIN": OFFSET_BYTES // es,  # weight offsets: whole 16-byte vectors
            "PREFETCH": pf_mode, "PF_CHUNK": chunk_bytes(pf_mode),
        },  # fmt: skip
        num_warps=4,
        num_stages=3,
    )


def expert_layer_step_kernel(h, scale1, shift, eps, gate, w_qkv, heads, cos, sin, kp, vp, bias,
                             scale: float, w_o, w_gu, w_down, work: StepWork | None = None,
                             max_spins: int = MAX_SPINS, table: LayerTable | None = None,
                             prefetch: bool = True) -> torch.Tensor:  # fmt: skip
    """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1) -> h after the
    layer, a new [N, W]; arguments as `plan_layer_step` (with `table`, layer 0's, and h
    after the table's last layer). `work`: a StepWork for these shapes, reused across calls
    (else one is made per call)."""
    if triton is None:
        raise RuntimeError("the persistent layer-step kernel needs triton, which is not installed")
    width, (hq, hkv, d) = h.shape[1], heads
    tensors = (h, w_qkv, w_o, w_gu, w_down, kp, vp, *gate)
    if any(t.dtype != h.dtype or t.stride(-1) != 1 for t in tensors) or hq % hkv:
        raise ValueError("persistent layer-step: h, the weights, K/V and gates share one dtype "
                         "with contiguous last dims; Hq a multiple of Hkv")  # fmt: skip
    if d & (d - 1) or d > 256 or w_qkv.shape != ((hq + 2 * hkv) * d, width):
        raise ValueError(f"persistent layer-step: head_dim {d} (a power of two <= 256), w_qkv "
                         f"{tuple(w_qkv.shape)} for heads {heads} and width {width}")  # fmt: skip
    if table is not None and table.layers > 1 and h.stride(0) != width:
        raise ValueError("persistent layer-steps: h contiguous (the layers between share its "
                         "row stride)")  # fmt: skip
    if work is None:
        work = StepWork.new(h, w_qkv, w_o, w_down, heads, kp.shape[0])
    out = torch.empty_like(h)
    plan_layer_step(h, scale1, shift, eps, gate, w_qkv, heads, cos, sin, kp, vp, bias, scale,
                    w_o, w_gu, w_down, work, out, max_spins, table, prefetch).run()  # fmt: skip
    return out


def expert_layer_step(h, scale1, shift, eps, gate, w_qkv, heads, cos, sin, kp, vp, bias,
                      scale: float, w_o, w_gu, w_down, work: StepWork | None = None,
                      table: LayerTable | None = None, prefetch: bool = True):  # fmt: skip
    """Dispatch: the persistent kernel on CUDA at inference -> h after the layer (or the
    table's layers); None elsewhere, or when its kernel cannot run here (the caller then
    runs the five kernels a layer: model/expert_step.py)."""
    if not use_kernel(h, w_qkv, w_o, w_gu, w_down):
        return None
    return try_kernel("expert_layer_step", expert_layer_step_kernel, h, scale1, shift, eps,
                      gate, w_qkv, heads, cos, sin, kp, vp, bias, scale, w_o, w_gu, w_down,
                      work, table=table, prefetch=prefetch)  # fmt: skip


def pi05_launches(dtype: torch.dtype = torch.bfloat16, n_prefix: int = 704) -> list[Launch]:
    """The launch at pi05 expert shapes over a 2-camera bucket, on `meta` tensors (for
    kernels/offline_compile.py)."""
    n, width, (hq, hkv, d), f = (PI05_EXPERT[k] for k in ("rows", "width", "heads", "mlp"))
    meta = {"dtype": dtype, "device": "meta"}
    h = torch.empty(n, width, **meta)
    vec = torch.empty(width, device="meta")
    w_qkv = torch.empty((hq + 2 * hkv) * d, width, **meta)
    w_o, w_down = torch.empty(width, hq * d, **meta), torch.empty(width, f, **meta)
    table = torch.empty(n, 1, d, device="meta")
    kv = torch.empty(n_prefix, hkv, d, **meta)
    work = StepWork.new(h, w_qkv, w_o, w_down, (hq, hkv, d), n_prefix)
    gate = torch.empty(width, **meta)
    # and the 18 layers of an Euler step in one launch (modulation [37, 10, W], the arena's
    # layers 2 slots x 1024 rows apart, one mask)
    layers = LayerTable(18, torch.empty(4, 18, dtype=torch.int64, device="meta"),
                        (2 * 10 * width,) * 3, 2 * 1024 * hkv * d, 0)  # fmt: skip
    return [plan_layer_step(h, (vec, vec), (vec, vec), (1e-6, 1e-6), (gate, gate), w_qkv,
                            (hq, hkv, d), table, table, kv, kv,
                            torch.empty(n_prefix + n, device="meta"), d**-0.5, w_o,
                            torch.empty(2 * f, width, **meta), w_down, work, h,
                            table=tab) for tab in (None, layers)]  # fmt: skip
