"""The action expert's weights into L2 one GEMM ahead (issue 33 item 1: "weights
prefetched"), on CUDA.

A layer-step runs four GEMMs in order: q/k/v, o_proj, gate/up, down (34.6 MB of bf16
weights at pi05), then the next layer's q/k/v. When GEMM g of a layer is about to run, a
prefetch of GEMM g + 1's weights (kernels/l2_prefetch.py) is launched on a side stream that
forks from the action's stream at that point: it runs beside GEMM g (and the norm or the
attention between them), so when g + 1 starts its weights are in L2, or on their way. The
order of use runs on across layers and Euler steps (the last layer's down prefetches layer
0's q/k/v for the next step), and the first q/k/v of `sample` is prefetched at its start.

At most two GEMMs' weights are in flight or in use at a time (gate/up + down: 25.2 MB at
pi05), so the prefetch runs only where that fits L2_SHARE of the GPU's L2 (the H100's and
H200's 50 MB; not a Jetson Orin's 4 MB, where it would evict what it fetched). The side
stream joins the action's stream at the end of `sample`, so a CUDA graph captures the
prefetches as a branch beside the denoise, and nothing waits on them: a prefetch is a hint.

Off CUDA nothing is launched; `log` (a list) records what would be prefetched, which the
tests check against the order of use. This covers the chain and the five-launch fused
path; the persistent launches (kernels/expert_layer_step.py) prefetch inside, each GEMM
item its share of its phase's weights before it waits (kernels/l2_prefetch.py
prefetch_share), so model/expert.py calls no hook around them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embodied_kv.kernels.l2_prefetch import prefetch_l2

PREFETCH = True  # untimed on a GPU: bench latency's graphs_noprefetch times the tree without
L2_SHARE = 0.75  # the two GEMMs' weights resident at once must fit this share of L2
GEMMS = ("qkv", "o", "gate_up", "down")  # a layer-step's GEMMs, in the order they run


def gemm_weights(layer) -> tuple[list[torch.Tensor], ...]:
    """The tensors each of the layer's four GEMMs reads, in GEMMS order (the fused q/k/v
    and gate/up weights where the fusions are in use, as CUDA runs them)."""
    attn, mlp = layer.self_attn, layer.mlp
    fused_a = attn.fusion is not None and attn.fusion.usable()
    fused_m = mlp.fusion is not None and mlp.fusion.usable()
    qkv = [attn.fusion.weight] if fused_a else [attn.q_proj.weight, attn.k_proj.weight,
                                                  attn.v_proj.weight]  # fmt: skip
    gu = [mlp.fusion.weight] if fused_m else [mlp.gate_proj.weight, mlp.up_proj.weight]
    return qkv, [attn.o_proj.weight], gu, [mlp.down_proj.weight]


def nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def peak_bytes(weights: Sequence[tuple[list[torch.Tensor], ...]]) -> int:
    """The most bytes resident at once under the schedule: a GEMM's weights and the next's."""
    order = [w for layer in weights for w in layer]
    return max(nbytes(a) + nbytes(b) for a, b in zip(order, order[1:] + order[:1], strict=True))


def fits(weights, l2_bytes: int) -> bool:
    """The schedule's peak fits L2_SHARE of an L2 of l2_bytes."""
    return peak_bytes(weights) <= L2_SHARE * l2_bytes


class StepPrefetch:
    """One `sample` call's prefetches: `at(k, i, g)` when GEMM g of layer i of Euler step k
    is about to run; `close()` joins the side stream. Inactive: every call does nothing (or
    only appends to `log`)."""

    def __init__(self, layers, steps: int, device: torch.device, enabled: bool = PREFETCH,
                 log: list | None = None, stream: torch.cuda.Stream | None = None):  # fmt: skip
        self.steps, self.log, self.stream, self._forked = steps, log, stream, False
        device = torch.device(device)
        self.cuda = enabled and device.type == "cuda"
        self.active = self.cuda or (enabled and log is not None)
        if not self.active:  # a CPU's every sample: nothing to look up
            return
        self.weights = [gemm_weights(layer) for layer in layers]
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.cuda = fits(self.weights, getattr(props, "L2_cache_size", 0))  # 0: unknown, off
            self.active = self.cuda or log is not None
        if self.cuda and self.stream is None:
            self.stream = torch.cuda.Stream(device)
        if self.active:
            self._prefetch(0, 0, 0)  # the first q/k/v, before the first layer's norm

    def next_of(self, k: int, i: int, g: int) -> tuple[int, int, int] | None:
        """The GEMM after GEMM g of layer i at Euler step k; None after the action's last."""
        g += 1
        if g == len(GEMMS):
            g, i = 0, i + 1
            if i == len(self.weights):
                i, k = 0, k + 1
        return None if k == self.steps else (k, i, g)

    def at(self, k: int, i: int, g: int) -> None:
        """GEMM g of layer i at step k is about to run: prefetch the next one's weights."""
        if self.active and (nxt := self.next_of(k, i, g)) is not None:
            self._prefetch(*nxt)

    def _prefetch(self, k: int, i: int, g: int) -> None:
        if self.log is not None:
            self.log.append((k, i, GEMMS[g]))
        if not self.cuda:
            return
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)  # fork here: beside what main runs next
        with torch.cuda.stream(self.stream):
            prefetch_l2(self.weights[i][g])
        self._forked = True

    def close(self) -> None:
        """Join the side stream into the action's stream (a graph's branch ends here)."""
        if self._forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._forked = False
