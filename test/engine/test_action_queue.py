import numpy as np
import pytest

from embodied_kv.engine.action_queue import ActionQueue


def chunk(value, h=4, a=2):
    return np.full((h, a), float(value)) + np.arange(h)[:, None]


def test_pop_follows_chunk_ticks_and_counts_misses():
    q = ActionQueue(horizon=4, action_dim=2)
    act, fresh = q.pop(0)
    assert not fresh and np.array_equal(act, np.zeros(2))  # nothing yet: hold zeros, a miss
    q.push(chunk(10), start_tick=1)
    assert [q.pop(t)[0][0] for t in (1, 2, 3, 4)] == [10, 11, 12, 13]
    act, fresh = q.pop(5)  # the chunk is used up: repeat the last action
    assert not fresh and act[0] == 13
    assert q.counters.misses == 2 and q.counters.ticks == 6


def test_blend_over_the_overlap():
    q = ActionQueue(horizon=4, action_dim=2, blend=2)
    q.push(chunk(0), start_tick=0)
    q.push(chunk(100), start_tick=2)  # overlaps old ticks 2, 3
    a2, a3, a4 = q.pop(2)[0][0], q.pop(3)[0][0], q.pop(4)[0][0]
    assert a2 == pytest.approx(1 / 3 * 100 + 2 / 3 * 2)
    assert a3 == pytest.approx(2 / 3 * 101 + 1 / 3 * 3)
    assert a4 == 102  # past the blend window: the new chunk alone


def test_blend_starts_where_the_chunk_lands_not_at_its_past_start():
    """A chunk observed at tick 2 that lands after tick 3 was popped (d = 2): ticks 2, 3
    are past, so the blend mixes ticks 4 and 5, where the robot switches."""
    q = ActionQueue(horizon=8, action_dim=2, blend=2)
    q.push(chunk(0, h=8), start_tick=0)
    assert [q.pop(t)[0][0] for t in range(4)] == [0, 1, 2, 3]
    q.push(chunk(100, h=8), start_tick=2)
    a4, a5, a6 = q.pop(4)[0][0], q.pop(5)[0][0], q.pop(6)[0][0]
    assert a4 == pytest.approx(1 / 3 * 102 + 2 / 3 * 4)
    assert a5 == pytest.approx(2 / 3 * 103 + 1 / 3 * 5)
    assert a6 == 104
    assert q.switches.last_delay == 2


def test_deterministic_and_validated():
    runs = []
    for _ in range(2):
        q = ActionQueue(4, 2, blend=1)
        q.push(chunk(1), 0)
        q.push(chunk(7), 3)
        runs.append(np.stack([q.pop(t)[0] for t in range(8)]))
    assert np.array_equal(runs[0], runs[1])
    with pytest.raises(ValueError):
        ActionQueue(4, 2).push(np.zeros((3, 2)), 0)
    with pytest.raises(ValueError):
        ActionQueue(4, 2, blend=4)
