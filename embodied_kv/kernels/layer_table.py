"""Which layers one persistent launch can run (kernels/expert_layer_step.py over an Euler
step's layers): each weight's element offset from layer 0's, the strides from one layer's
modulation vectors, K/V and mask to the next's, and the checks that refuse layers that
cannot share a launch (the caller then launches a layer at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

OFFSET_BYTES = 16  # a layer's weights start this many bytes' multiple from layer 0's


@dataclass(frozen=True)
class LayerTable:
    """What a launch over several layers reads beyond layer 0's tensors: each weight's
    element offset from layer 0's (int64 [4, L] on the device: q/k/v, o_proj, gate/up,
    down; whole OFFSET_BYTES vectors, so the loads keep their width) and the element
    strides from one layer's modulation vectors, prefix K/V and mask to the next's (0: all
    layers share it)."""

    layers: int
    offsets: torch.Tensor
    stride_mod: tuple[int, int, int] = (0, 0, 0)  # the norms' scales, shifts; the gates
    stride_kv: int = 0
    stride_bias: int = 0


def uniform_stride(tensors: list[torch.Tensor]) -> int | None:
    """The element stride from each tensor's start to the next's when it is one number
    (views of one storage at equal steps); None otherwise."""
    es = tensors[0].element_size()
    steps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(tensors, tensors[1:], strict=False)}
    if len(steps) > 1 or any(x % es for x in steps):
        return None
    return next(iter(steps), 0) // es


def weight_offsets(weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
    """Per layer its four weights (q/k/v, o_proj, gate/up, down) -> each one's element offset
    from layer 0's, int64 [4, L] on the host; None when the layers cannot share a launch
    (shapes or strides that differ, an offset that is not whole 16-byte vectors)."""
    first = weights[0]
    same = [a.shape == b.shape and a.stride() == b.stride()
            for w in weights for a, b in zip(w, first, strict=True)]  # fmt: skip
    offsets = [[(w[j].data_ptr() - first[j].data_ptr()) for w in weights] for j in range(4)]
    es = first[0].element_size()
    if not all(same) or any(o % OFFSET_BYTES for row in offsets for o in row):
        return None
    return torch.tensor(offsets, dtype=torch.int64) // es


def layer_table(offsets: torch.Tensor, mods: list[tuple[torch.Tensor, ...]],
                kps: list[torch.Tensor], vps: list[torch.Tensor],
                biases: list[torch.Tensor]) -> LayerTable | None:  # fmt: skip
    """The table of a launch over the layers of `offsets` (weight_offsets, on the device);
    per layer its six modulation vectors (the two norms' scales, their shifts, the two
    gates), K, V and mask. None when those are not at equal steps from one layer to the
    next (each pair of vectors sharing one stride)."""
    pairs = ((0, 1), (2, 3), (4, 5))  # the scales, the shifts, the gates
    mod = [{uniform_stride([m[j] for m in mods]) for j in pair} for pair in pairs]
    kv = {uniform_stride(kps), uniform_stride(vps)}
    bias = uniform_stride(biases)
    if any(len(m) != 1 or None in m for m in mod) or len(kv) != 1 or None in kv or bias is None:
        return None
    return LayerTable(offsets.shape[1], offsets, tuple(m.pop() for m in mod), kv.pop(), bias)
