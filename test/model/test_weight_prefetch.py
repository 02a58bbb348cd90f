"""The expert's weights prefetched into L2 one GEMM ahead (model/weight_prefetch.py): the
schedule is the order in which a `sample` runs its GEMMs, shifted by one (checked on the
CPU through the log the prefetcher keeps there, as the chain calls it); its peak fits the
H100's L2 at pi05 widths and is refused on a small one; nothing it does changes a byte
(on a GPU: eager, and replayed from a CUDA graph with the prefetches on a side branch)."""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from embodied_kv.model import weight_prefetch as wp
from embodied_kv.model.config import get_preset
from embodied_kv.model.fused import fuse_projections
from embodied_kv.model.synthetic import synthetic_observation
from embodied_kv.model.vla import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py

H100_L2 = 50 * 1024 * 1024
ORIN_L2 = 4 * 1024 * 1024


def prefilled(m, device="cpu"):
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 3)))
    return arena, slot, arena.slot_len(slot)


def gemm_order(layers: int, steps: int) -> list[tuple[int, int, str]]:
    """Every GEMM of a sample, in the order it runs."""
    return [(k, i, g) for k in range(steps) for i in range(layers) for g in wp.GEMMS]


class GemmLog(TorchFunctionMode):
    """Appends ("run", layer, GEMM) to `log` whenever F.linear reads one of the expert's
    layer weights (consecutive reads of one GEMM's unfused parts once)."""

    def __init__(self, layers, log):
        super().__init__()
        self.log = log
        self.owner = {w.data_ptr(): (i, wp.GEMMS[g]) for i, layer in enumerate(layers)
                      for g, ws in enumerate(wp.gemm_weights(layer)) for w in ws}  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            who = self.owner.get(args[1].data_ptr())
            if who is not None and self.log[-1] != ("run", *who):
                self.log.append(("run", *who))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [False, True])
def test_the_prefetches_run_one_gemm_ahead_and_change_no_byte(fused):
    m = build_model(get_preset("tiny"))
    if fused:
        fuse_projections(m)
    arena, slot, n = prefilled(m)
    noise = m.make_noise(1)
    log: list = []
    with torch.no_grad():
        m.expert.prefetch_weights = False
        plain = m.sample_actions(arena, slot, n, noise)
        m.expert.prefetch_weights, m.expert.prefetch_log = True, log
        with GemmLog(m.expert.layers, log):
            chunk = m.sample_actions(arena, slot, n, noise)
    assert torch.equal(chunk, plain)
    # every GEMM's weights once, in the order of use, each issued just before the GEMM
    # ahead of it runs: prefetch 0, prefetch 1, run 0, prefetch 2, run 1, ...
    order = gemm_order(len(m.expert.layers), m.cfg.denoise_steps)
    want = [order[0]]
    for j, (_, i, g) in enumerate(order):
        want += [order[j + 1]] if j + 1 < len(order) else []
        want.append(("run", i, g))
    assert log == want


def test_the_prefetcher_is_inert_without_cuda_or_a_log():
    m = build_model(get_preset("tiny"))
    pf = wp.StepPrefetch(m.expert.layers, 2, torch.device("cpu"))
    assert not pf.active and pf.stream is None
    pf.at(0, 0, 0)
    pf.close()
    off = wp.StepPrefetch(m.expert.layers, 2, "cpu", enabled=False, log=[])
    off.at(0, 0, 0)
    assert off.log == []


def test_next_of_walks_layers_and_steps_and_stops_after_the_last():
    m = build_model(get_preset("tiny"))
    pf = wp.StepPrefetch(m.expert.layers, 2, "cpu", log=[])
    last = len(m.expert.layers) - 1
    assert pf.next_of(0, 0, 0) == (0, 0, 1)
    assert pf.next_of(0, 0, 3) == (0, 1, 0)
    assert pf.next_of(0, last, 3) == (1, 0, 0)  # the next Euler step's first q/k/v
    assert pf.next_of(1, last, 3) is None


def pi05_layer_weights(device="meta"):
    """The expert's four GEMMs' weights at pi05 widths, bf16, fused as CUDA runs them."""
    (hq, hkv, d), w, f = (8, 1, 256), 1024, 4096
    meta = {"dtype": torch.bfloat16, "device": device}
    return ([torch.empty((hq + 2 * hkv) * d, w, **meta)], [torch.empty(w, hq * d, **meta)],
            [torch.empty(2 * f, w, **meta)], [torch.empty(w, f, **meta)])  # fmt: skip


def test_the_peak_is_two_gemms_and_fits_an_h100_not_an_orin():
    layers = [pi05_layer_weights()] * 18
    peak = wp.peak_bytes(layers)
    assert peak == (2 * 4096 * 1024 + 1024 * 4096) * 2  # gate/up + down: 25.2 MB
    assert wp.fits(layers, H100_L2)
    assert not wp.fits(layers, ORIN_L2)  # there it would evict what it fetched


def test_gemm_weights_are_what_the_gemms_read():
    m = build_model(get_preset("tiny"))
    layer = m.expert.layers[0]
    qkv, o, gu, down = wp.gemm_weights(layer)
    assert len(qkv) == 3 and len(gu) == 2  # unfused: three and two GEMMs
    fuse_projections(m)
    with torch.no_grad():
        qkv, o, gu, down = wp.gemm_weights(layer)
    assert qkv == [layer.self_attn.fusion.weight] and gu == [layer.mlp.fusion.weight]
    assert o == [layer.self_attn.o_proj.weight] and down == [layer.mlp.down_proj.weight]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefetch kernels need a GPU")
@pytest.mark.parametrize("fused_step", [False, True])
def test_on_cuda_prefetch_changes_no_byte_eager_or_replayed(fused_step):
    from embodied_kv.engine.graphs import GraphRunner

    m = build_model(get_preset("tiny"), "cuda")  # bf16, q/k/v and gate/up fused
    m.expert.fused_layer_step = fused_step
    arena = m.new_arena(2, 256)
    slot = arena.allocate()
    with torch.no_grad():
        m.prefill(arena, slot, m.embed_prefix(synthetic_observation(m.cfg, 3)))
        n = arena.slot_len(slot)
        noise = m.make_noise(1)
        m.expert.prefetch_weights = False
        plain = m.sample_actions(arena, slot, n, noise)
        replayed_plain = GraphRunner(m, arena, mode="cuda").sample_actions(slot, n, noise)
        m.expert.prefetch_weights = True
        eager = m.sample_actions(arena, slot, n, noise)
        runner = GraphRunner(m, arena, mode="cuda")  # captured with the prefetch branch
        replayed = runner.sample_actions(slot, n, noise)
        again = runner.sample_actions(slot, n, noise)
        torch.cuda.synchronize()
    assert m.expert._prefetch_stream is not None  # it ran
    assert torch.equal(eager, plain)
    assert torch.equal(replayed, replayed_plain) and torch.equal(replayed, again)
