"""`bench rtc`'s timeline: the injected delay reaches the queue's measurement and RTC's
guide, switches and their jumps are counted where chunks land, temporal ensembling
averages landed chunks with ACT's weights. World preset, random weights (structure, not
skill); the real run (shipped weights) is bench/results/.../rtc_quick.json."""

import numpy as np
import pytest

from embodied_kv.bench import rtc as bench

from ..kv.conftest import world_model  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")  # test/conftest.py


@pytest.mark.parametrize("delay", [2, 8])
def test_injected_delay_is_measured_and_switches_counted(world_model, delay):  # noqa: F811
    ex = bench.Guided("error")
    engine = bench.make_engine(world_model, ex.rtc)
    trace = bench.run_episode(engine, ex, 0, delay)
    period = max(bench.REPLAN, delay)
    # every chunk after the first lands d ticks after its cycle starts, if within the budget
    landings = [t0 + delay for t0 in range(period, bench.TICKS, period) if t0 + delay < bench.TICKS]
    assert not trace.success  # random weights
    assert len(trace.actions) == bench.TICKS  # every tick executed once
    assert len(trace.jumps) == len(landings)
    assert engine.queue.switches.last_delay == delay
    counters = engine.loop.rtc.counters
    assert counters.guided == counters.chunks - 1 and counters.last_delay == delay
    assert len(trace.lead_gaps) == counters.guided
    row = bench.summarise([trace])
    assert row["switches"] == len(trace.jumps) and row["ticks"] == bench.TICKS
    assert row["jump_max"] == max(trace.jumps)


def test_ensemble_weights_the_oldest_chunk_most():
    ex = bench.Ensemble()

    class _Queue:
        def pop(self, tick):
            return np.zeros(2), False

    class _Engine:
        queue = _Queue()
        robot = type("R", (), {"action_dim": 2})()

    ex.reset(_Engine())
    ex.landed(np.ones((4, 2)), 0)
    ex.landed(3 * np.ones((4, 2)), 2)
    assert ex.action(1).tolist() == [1.0, 1.0]
    w = np.exp(-bench.ENSEMBLE_M * np.arange(2))
    want = (w[0] * 1 + w[1] * 3) / w.sum()
    assert np.allclose(ex.action(3), want)
    assert ex.action(9).tolist() == pytest.approx([want, want])  # none covers: the last
