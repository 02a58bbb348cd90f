"""DAgger's visited states (issue 34): the file round-trips exactly and refuses what it
cannot trust, a replay rebuilds the scene the policy reached, samples drawn there carry
the expert's labels, and a share of 0 leaves every other sample's bytes as they were."""

import json

import numpy as np
import pytest

from embodied_kv.eval import delayed
from embodied_kv.eval.items import EvalConfig
from embodied_kv.eval.runners import EngineRunner
from embodied_kv.eval.visited import VISITED_SEED_BASE, collect, collect_delayed, main
from embodied_kv.eval.world import make_engine, random_model
from embodied_kv.model.trained import world_config
from embodied_kv.train.config import EVAL_SEED_BASE
from embodied_kv.world.dataset import DataConfig, make_sample
from embodied_kv.world.expert import expert_chunk
from embodied_kv.world.tasks import episode
from embodied_kv.world.visited import VisitedState, load_visited, save_visited


def states_of(n=3):
    rng = np.random.default_rng(0)
    return [VisitedState(7 + i, rng.uniform(-1, 1, size=(i * 5, 4))) for i in range(n)]


def test_the_file_round_trips_and_a_replay_is_the_scene(tmp_path):
    states = states_of()
    path = save_visited(states, tmp_path / "v.json")
    assert [p.name for p in tmp_path.iterdir()] == ["v.json"]  # no temp file left
    back = load_visited(path)
    assert [s.seed for s in back] == [s.seed for s in states]
    assert all(np.array_equal(a.actions, b.actions) for a, b in zip(back, states, strict=True))
    scene, task = episode(states[2].seed)
    for a in states[2].actions:
        scene.step(a)
    replayed, same_task = back[2].replay()
    assert same_task == task and replayed == scene


@pytest.mark.parametrize("doc, says", [
    ({"format": "other", "version": 1, "states": []}, "not a"),
    ({"format": "embodied_kv.visited", "version": 2, "states": []}, "version"),
    ({"format": "embodied_kv.visited", "version": 1, "states": []}, "1.."),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": True, "actions": []}]}, "seed"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": -1, "actions": []}]}, "seed"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": 1, "actions": [[0, 0, 0]]}]}, "actions"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": 1, "actions": [[0, 0, 0, 0, 0, 0, 0, 0]]}]}, "actions"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": 1, "actions": [[0, "x", 0, 0]]}]}, "actions"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": 1, "actions": [[0, 1e400, 0, 0]]}]}, "finite"),
    ({"format": "embodied_kv.visited", "version": 1,
      "states": [{"seed": 1, "actions": [], "code": "import os"}]}, "exactly"),
])  # fmt: skip
def test_a_bad_file_is_refused_with_the_reason(tmp_path, doc, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=says):
        load_visited(path)


def test_not_json_and_missing_files_are_refused(tmp_path):
    (tmp_path / "x.json").write_bytes(b"\xff\x00 not json")
    for p in (tmp_path / "x.json", tmp_path / "absent.json"):
        with pytest.raises(ValueError, match="visited states"):
            load_visited(p)


def test_samples_at_visited_states_carry_the_expert_s_labels(tmp_path):
    path = save_visited(states_of(), tmp_path / "v.json")
    cfg = DataConfig(rollout="task", visited=str(path), visited_share=1.0)
    seen = set()
    for seed in range(12):
        s = make_sample(cfg, seed)
        match = [v for v in load_visited(path) if np.array_equal(v.replay()[0].state(), s.state)]
        assert match, "the sample's state is one of the file's"
        scene, task = match[0].replay()
        assert s.instruction == task.instruction
        assert np.array_equal(s.actions, expert_chunk(scene, task, cfg.horizon))
        seen.add(match[0].seed)
    assert len(seen) > 1
    plain = DataConfig(rollout="task")  # share 0: not one extra draw
    unused = DataConfig(rollout="task", visited=str(path), visited_share=0.0)
    for seed in range(4):
        a, b = make_sample(plain, seed), make_sample(unused, seed)
        assert np.array_equal(a.images, b.images) and a.turns == b.turns
    with pytest.raises(ValueError, match="visited states file"):
        DataConfig(visited_share=0.5)


def test_collect_runs_the_engine_on_seeds_apart_from_training_and_eval(tmp_path):
    cfg = EvalConfig(max_cycles=4)
    runner = EngineRunner(make_engine(random_model(world_config()), cfg))
    states = collect(runner, cfg, episodes=2)
    assert {s.seed for s in states} == {VISITED_SEED_BASE, VISITED_SEED_BASE + 1}
    assert VISITED_SEED_BASE < EVAL_SEED_BASE
    assert [len(s.actions) for s in states] == [5, 10, 15] * 2  # random weights never succeed
    # each state is the previous one and the policy's next replan_every actions
    assert np.array_equal(states[1].actions[:5], states[0].actions)
    out = tmp_path / "states.json"
    assert main(["--episodes", "1", "--out", str(out)]) == 0  # the shipped weights
    assert 1 <= len(load_visited(out)) <= EvalConfig().max_cycles - 1


def test_collect_delayed_records_each_cycle_of_each_executor_and_delay(tmp_path):
    """`eval visited --delays`: the states the delayed loop (eval/delayed.py) reaches, one per
    cycle after the first, for every executor and delay; a replay is the scene the policy
    saw (its observation's state)."""
    model = random_model(world_config())
    states = collect_delayed(model, 1, delays=(0, 8), executors=("naive", "rtc-error"), ticks=20)
    # d = 0: cycles at 0, 5, 10, 15; d = 8: at 0, 8, 16 (random weights never succeed)
    assert [len(s.actions) for s in states] == [5, 10, 15, 8, 16] * 2
    assert {s.seed for s in states} == {VISITED_SEED_BASE}
    ex = delayed.executor("naive")
    seen = []
    engine = delayed.make_engine(model, ex.rtc)
    real_observe = engine.observe
    engine.observe = lambda obs: (seen.append(obs.state.copy()), real_observe(obs))[1]
    delayed.run_episode(engine, ex, VISITED_SEED_BASE, 8, 20)
    for state, obs_state in zip(states[3:5], seen[1:], strict=True):
        scene, _ = state.replay()
        assert np.array_equal(scene.state(), obs_state)
    with pytest.raises(ValueError, match="executor 'fast'"):
        collect_delayed(model, 1, executors=("fast",))
    out = tmp_path / "states.json"
    argv = ["--episodes", "1", "--delays", "4", "--executors", "rtc-error", "--out", str(out)]
    assert main(argv) == 0  # the shipped weights
    assert len(load_visited(out)) >= 1
