"""KEEP's host-work budget per plan (issue #38): the graphed plan (the GPU path) costs
the host at most one sync (the first token read), no device -> host copy and a fixed
handful of host -> device copies, whatever the number of memory segments; no method's
plan moves memory blocks through the host tier (they stay on the device, kv/memory.py).

Counted on the CPU by bench/host_work.py over `bench keep`'s own census request (the
memory's refresh after two updates, then the prefill and the first token read), with
the graphs in emulation (the capture and replay code the GPU runs)."""

import argparse

import pytest
import torch

from embodied_kv.bench.keep import load, run_segments
from embodied_kv.kv.selectors import KeepConfig

PLAN_SYNCS = 1  # the first token's read; a replayed prefill itself never waits
PREFILL_H2D = 4  # the prompt's ids, the re-rotation deltas, the plan's index tensors
BLOCK_H2D = 4  # per block the refresh computes (its packed step's ids and plan)
BLOCK_LAUNCHES = 16  # per block: one step replayed, its loads, K and V copied (measured 9-10;
# eager, one packed step of the model: ~176)
# one replay, the request's loads, and the image: a block an update replaced is one
# device copy per K / V; a repack (the pieces changed: a group turned static) one per piece
PREFILL_LAUNCHES = 24 + 2 * 40
SEGMENTS = (10, 40)


@pytest.fixture(scope="module")
def work():
    ratios = (KeepConfig.first_ratio, KeepConfig.last_ratio)
    args = argparse.Namespace(weights="", preset="tiny", device="cpu", requests=1, updates=2,
                              window=10, seed=0, graphs="emulate", keep_ratios=ratios)  # fmt: skip
    torch.manual_seed(0)
    model, _ = load(args)
    return {n: run_segments(model, n, args, "cpu")["host_work"] for n in SEGMENTS}


def test_the_graphed_keep_plan_holds_its_host_budget_at_every_memory_size(work):
    for n in SEGMENTS:
        w = work[n]["keep-graphs"]
        pre, ref = w["prefill"], w["refresh"]
        assert pre["syncs"] + ref["syncs"] <= PLAN_SYNCS, (n, w)
        assert pre["d2h"] == 0 and ref["d2h"] == 0, (n, w)
        assert pre["h2d"] <= PREFILL_H2D and pre["graph_replays"] == 1, (n, pre)
        assert ref["h2d"] <= BLOCK_H2D * w["blocks_computed"], (n, w)
        assert ref["launches"] <= BLOCK_LAUNCHES * w["blocks_computed"], (n, w)
        assert pre["launches"] <= PREFILL_LAUNCHES, (n, pre)
    # the prefill's host waits and copies do not grow with the memory
    small, large = (work[n]["keep-graphs"]["prefill"] for n in SEGMENTS)
    assert small["syncs"] == large["syncs"] and large["h2d"] <= small["h2d"]


def test_no_plan_moves_memory_blocks_through_the_host(work):
    """The blocks an update invalidated are computed and kept on the device: no refresh
    reads them back (was 4 blocking copies a plan: K and V of two blocks), and no prefill
    copies cached KV from the host (its bytes would be the memory's, ~1 MB here)."""
    for n in SEGMENTS:
        for name, w in work[n].items():
            assert w["refresh"]["d2h"] == 0 and w["refresh"]["syncs"] == 0, (n, name, w)
            assert w["prefill"]["h2d_bytes"] < 64 << 10, (n, name, w["prefill"])


def test_the_eager_paths_show_their_host_work(work):
    """The counter tells the designs apart on the CPU: eager KEEP waits on the host at
    every layer where it narrows (its selector reads masks back), full recomputation once."""
    w = work[40]
    assert w["full"]["prefill"]["syncs"] == 1
    assert w["keep"]["prefill"]["syncs"] > 10 * w["keep-graphs"]["prefill"]["syncs"]
    assert w["keep"]["prefill"]["launches"] > 5 * w["keep-graphs"]["prefill"]["launches"]
