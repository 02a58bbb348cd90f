"""Prices of the elementwise and fused GEMM kernels for `bench estimate` (bench/estimate.py):
(FLOPs, bytes moved) of one launch, from the arguments the op is called with; a list where
the op is several kernels. The attention kernels' prices, which calibration replaces
(bench/estimate_calibration.py), stay in bench/estimate.py."""

from __future__ import annotations

from embodied_kv.kernels import gemm_residual
from embodied_kv.kernels.rope import adjacent_heads, adjacent_view


def norm_cost(x, mult, eps, shift=None, add_one=False) -> tuple[float, float]:
    """The fused RMSNorm kernel (kernels/rms_norm.py): the rows read once and written once,
    the fp32 multiplier (and shift) once; ~6 FLOPs per element, never the bound."""
    params = mult.numel() * 4 * (1 if shift is None else 2)
    return 6.0 * x.numel(), 2.0 * x.numel() * x.element_size() + params


def rope_cost(x, cos, sin) -> tuple[float, float]:
    """The RoPE kernel (kernels/rope.py): x read once, written once, the two table rows."""
    return 3.0 * x.numel(), 2.0 * x.numel() * x.element_size() + 2 * cos.numel() * 4


def rope_pair_cost(q, k, cos, sin) -> tuple[float, float] | list[tuple[float, float]]:
    """kernels/rope.py rope_pair: one kernel over q and k where they are adjacent heads of
    the fused q/k/v output (as on CUDA with model/fused.py), else one each."""
    if adjacent_heads(q, k):
        return rope_cost(adjacent_view(q, k), cos, sin)
    return [rope_cost(q, cos, sin), rope_cost(k, cos, sin)]


def rope_store_cost(q, k, v, cos, sin, k_cache, v_cache, slot, row, fused=True) -> tuple | list:
    """kernels/rope_store.py: q, k and v read once, q written, k and v written into the
    arena, the tables' rows and the indices read; unfused, two rotations and two copies."""
    e = q.element_size()
    if not fused:
        copy = (0.0, 2.0 * k.numel() * e + 2 * slot.nbytes)
        return [rope_cost(q, cos, sin), rope_cost(k, cos, sin), copy, copy]
    moved = 2.0 * (q.numel() + k.numel() + v.numel()) * e
    return 3.0 * (q.numel() + k.numel()), moved + 2 * cos.numel() * 4 + 2 * slot.nbytes


def add_rms_norm_cost(h, y, weight, eps, fused=True) -> tuple | list:
    """The backbone's residual add + RMSNorm (kernels/gated_rms_norm.py add_rms_norm): h and
    y read once, the stream and the norm written once; unfused, the add and the norm."""
    e = h.element_size()
    if not fused:
        return [(1.0 * h.numel(), 3.0 * h.numel() * e), norm_cost(h, weight, eps)]
    return 7.0 * h.numel(), 4.0 * h.numel() * e + weight.nbytes


def gated_rms_norm_cost(h, y, gate, scale1, shift, eps) -> tuple | list:
    """kernels/gated_rms_norm.py: h and y read once, the stream and the norm written once;
    with a per-row modulation (CUDA runs the references there) addcmul, then the norm."""
    e, w = h.element_size(), h.shape[-1]
    if scale1.shape == (w,) and shift.shape == (w,) and gate.shape == (w,):
        return 8.0 * h.numel(), 4.0 * h.numel() * e + gate.nbytes + 2 * w * 4
    return [(2.0 * h.numel(), 3.0 * h.numel() * e + gate.nbytes), norm_cost(h, scale1, eps, shift)]


def action_in_cost(x_t, w, b, dtype) -> tuple[float, float]:
    """kernels/flow_io.py action_in: the fp32 in-projection with its cast, one kernel."""
    m, n = x_t.shape[0], w.shape[0]
    return 2.0 * m * n * w.shape[1], x_t.nbytes + w.nbytes + b.nbytes + m * n * dtype.itemsize


def euler_out_cost(x, xn, w, b, dt) -> tuple[float, float]:
    """kernels/flow_io.py euler_out: the fp32 head, its cast and the Euler step, one kernel."""
    return 2.0 * x.numel() * w.shape[1] + 2 * x.numel(), xn.nbytes + w.nbytes + 2 * x.nbytes


def add_layer_norm_cost(x, y, weight, bias, eps) -> tuple[float, float]:
    """The vision tower's residual add + LayerNorm (kernels/add_layer_norm.py): x and y
    read once, the sum and the norm written once."""
    return 8.0 * x.numel(), 4.0 * x.numel() * x.element_size() + 2 * weight.nbytes


def gelu_gate_cost(gate, up) -> tuple[float, float]:
    """The GELU-gate kernel (kernels/gelu_gate.py): gate and up read once, the product written."""
    return 10.0 * gate.numel(), 3.0 * gate.numel() * gate.element_size()


def norm_qkv_rope_cost(h, scale1, shift, eps, w_qkv, sizes, cos, sin) -> tuple[float, float]:
    """The fused norm -> q/k/v -> RoPE kernel (kernels/norm_qkv_rope.py): the weights once, h
    read by every column block (L2-resident, counted once), q/k/v written once."""
    n, w = h.shape
    out = sum(sizes)
    e = h.element_size()
    return 2.0 * n * w * out, (w_qkv.numel() + n * w + n * out) * e + 2 * cos.numel() * 4


def norm_gate_up_cost(h, scale1, shift, eps, w_gate_up, hidden) -> tuple[float, float]:
    """The fused norm -> gate/up -> GELU-gate kernel: the weights once, the product written."""
    n, w = h.shape
    return 4.0 * n * w * hidden, (w_gate_up.numel() + n * w + n * hidden) * h.element_size()


def linear_gated_residual_cost(h, x, w, gate, work=None) -> tuple[float, float]:
    """The GEMM with the gated residual in its epilogue (kernels/gemm_residual.py): x and the
    weights once, h read and the result written, the split-K fp32 partials written and read."""
    (n, k), width = x.shape, w.shape[0]
    split_k = gemm_residual.gemm_config(n, width, k, x.dtype).split_k
    partials = 0 if split_k == 1 else 2.0 * split_k * n * width * 4
    moved = (x.numel() + w.numel() + 3 * n * width) * x.element_size() + partials
    return 2.0 * n * k * width, moved
