"""The calibrated estimate's floor (bench/estimate_floor.py): the GEMMs alone at the fitted
rates are a lower bound of every kernel structure the model prices, move only with the
rates, and stand above issue 33's 10 ms at 2 cameras for the measured code."""

import copy
import json

import pytest

from embodied_kv.bench import estimate_floor as ef
from embodied_kv.bench import estimate_h200 as h2

COMMIT = "408d8ee"  # the latest measured code (H200, 2026-12-04, call 3)


@pytest.fixture(scope="module")
def censuses():
    stored = h2.stored()
    return {s: stored[(COMMIT, s)] for s in h2.PATHS}


def test_the_floor_is_under_every_layer_steps_estimate(censuses):
    low = ef.floor(censuses, h2.host_ms(COMMIT))
    for path, census in censuses.items():
        priced = h2.price(census, h2.host_ms(COMMIT))
        for cams, r in low.items():
            for g in (*h2.REGIONS, "total"):
                assert r[g] < priced[cams][g], (path, cams, g)
            assert r["host"] == priced[cams]["host"]
    # the denoise's floor is the lesser layer-step's (the chain: cuBLAS at 50 rows beats the
    # Triton kernels' fitted bandwidth)
    one = {s: ef.floor({s: c}, h2.host_ms(COMMIT)) for s, c in censuses.items()}
    k = h2.key(2)
    assert low[k]["denoise"] == min(f[k]["denoise"] for f in one.values())
    assert low[k]["denoise"] == one["chain"][k]["denoise"]


def test_no_structure_moves_it(censuses):
    # launches and every kernel that is not a GEMM are free in the floor: more of them, or
    # none, and it is the same; a faster GEMM rate lowers it
    host = h2.host_ms(COMMIT)
    base = ef.floor(censuses, host)[h2.key(2)]["total"]
    busy = copy.deepcopy(censuses)
    for census in busy.values():
        for by_region in census["cameras"].values():
            for kernels in by_region.values():
                for region in kernels.values():
                    for k in region:
                        if k["cls"] not in ef.GEMM_CLASSES:
                            k["n"] *= 10
    assert ef.floor(busy, host)[h2.key(2)]["total"] == pytest.approx(base, rel=1e-12)
    priced = h2.price(busy["chain"], host)[h2.key(2)]["total"]
    assert priced > h2.price(censuses["chain"], host)[h2.key(2)]["total"] + 10
    faster = dict(h2.params(), gemm_compute_eff=0.95, gemm_ramp_rows=128)
    assert ef.floor(censuses, host, faster)[h2.key(2)]["total"] < base - 1.0


def test_above_10_ms_at_2_cameras(censuses):
    # issue 33's CPU-side criterion (estimate <= 10 ms) is out of reach of kernel structure
    # at the fitted rates: the GEMMs alone with the measured host term exceed it
    low = ef.floor(censuses, h2.host_ms(COMMIT))
    assert low[h2.key(2)]["total"] > 10.0
    assert low[h2.key(3)]["total"] > low[h2.key(2)]["total"]
    rows = ef.floor_rows(censuses)
    assert [r["cameras"] for r in rows] == [2, 3]
    assert rows[0]["total_ms"] == pytest.approx(low[h2.key(2)]["total"])


def test_the_measured_floor_counts_every_gemm_of_the_profile():
    profile = json.loads(ef.PROFILE.read_text())
    for row in profile["rows"]:
        k = row["kernels"]
        gemm_calls = sum(r["calls"] // k["cycles"] for r in k["rows"] if ef.is_gemm(r["name"]))
        assert gemm_calls == 72 + 108  # the prefill's 18 x 4 and SigLIP's 27 x 4
        names = [r["name"] for r in k["rows"] if ef.is_attention(r["name"])]
        assert len(names) == 2 and names[0] == "_prefill_tile_fwd"
    assert not ef.is_gemm("void sgemm_largek_lds64<true, false, 5, 5, 4, 4, 4, 34>(float*")


def test_measured_floor_leaves_less_than_the_expert_attention_under_10_ms():
    rows = {r["cameras"]: r for r in ef.measured_floor()}
    two = rows[2]
    # 2026-12-04 H200 profile: the prefill's four cuBLAS GEMMs 254 us a layer, SigLIP's 42
    assert two["gemm_ms"] == pytest.approx(5.71, abs=0.01)
    assert two["expert_weights_ms"] == pytest.approx(1.30, abs=0.01)
    assert two["total_ms"] < 10 < two["total_ms"] + two["expert_attention_ms"]
    assert rows[3]["total_ms"] > 10
