"""Rollback by steps keeps working after a rollback by name (frame numbers repeat)."""

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.model.synthetic import synthetic_observation


def test_rollback_by_steps_after_rollback_by_name(tiny_model):
    engine = Engine(EngineConfig(control_hz=0.01, history=4), model=tiny_model)
    obs = synthetic_observation(tiny_model.cfg, 0)
    engine.begin_episode()
    engine.observe(obs)
    for i in range(3):
        engine.cycle(5 * i)
    engine.snapshot("mark")
    for i in range(3, 7):
        engine.cycle(5 * i)
    engine.rollback("mark")
    for i in range(7, 9):  # frames 3 and 4 again: their boundaries are taken a second time
        engine.cycle(5 * i)
    assert len(engine.history) == len(set(engine.history)) <= 4
    assert all(name in engine.store for name in engine.history)
    engine.rollback(steps_back=1)
    assert engine.frame == 4
