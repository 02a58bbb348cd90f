"""The calibrated H100 estimate (bench/estimate_calibration.py): the stored censuses priced
with the committed constants reproduce the measured H100 regions, the constants are the
grid fit's, and today's census records and prices."""

import math

import pytest
import torch

from embodied_kv.bench import estimate_calibration as cal


@pytest.fixture(scope="module")
def old():
    return cal.load(cal.STORED)


def test_the_97dd254_census_reproduces_the_11_22_regions_within_15_percent(old):
    priced = cal.price(old)
    assert set(priced) == {"2/151", "3/153"}  # the measured prefixes, 663 and 921 rows
    for key, regions in cal.errors(priced).items():
        for region, err in regions.items():
            assert abs(err) <= 0.15, (key, region, err)
    for cams in (2, 3):
        total = priced[f"{cams}/{cal.MEASURED_PREFIX[cams] - 256 * cams}"]["total"]
        assert abs(total / cal.MEASURED_1122_ACTION_MS[cams] - 1) <= 0.15


def test_the_133f594_census_predicts_the_11_23_action_within_15_percent():
    priced = cal.price(cal.load(cal.STORED_133F594))
    for cams in (2, 3):
        total = priced[f"{cams}/{cal.MEASURED_PREFIX[cams] - 256 * cams}"]["total"]
        assert abs(total / cal.MEASURED_1123_ACTION_MS[cams] - 1) <= 0.15, (cams, total)


def test_the_committed_constants_are_the_grid_fit(old):
    fitted = cal.fit(old)
    for name in cal.FITTED:
        assert math.isclose(fitted[name], cal.params()[name], rel_tol=1e-9), name


def test_other_constants_move_the_estimate(old):
    # a different model must miss: the test above can fail
    slow = dict(cal.params(), expert_step_s=10 * cal.EXPERT_STEP_S)
    assert cal.worst(cal.price(old, slow)) > 0.15


def test_todays_census_records_and_prices_at_2_cameras():
    torch.set_num_threads(1)
    priced = cal.price(cal.record(((2, 48),)))["2/48"]
    for region in ("vision", "prefill", "denoise"):
        assert 0 < priced[region] < 30, (region, priced)
    assert priced["total"] == pytest.approx(sum(v for k, v in priced.items() if k != "total"))
