"""`eval world` through the real engine: random weights sit at or below chance, and the
scripted expert in the same closed loop succeeds (the world and its success test agree)."""

import json
import re

import numpy as np

from embodied_kv.cli import main
from embodied_kv.eval.items import STAGE_ORDER, EvalConfig, closed_loop, closed_loop_stages
from embodied_kv.eval.world import print_stages, run, where_accuracy
from embodied_kv.world.questions import where_word


def test_random_floor_near_chance_and_expert_ceiling():
    cfg = EvalConfig(episodes=3, questions=6, memory=4)
    result = run("", "", cfg)
    rows, chance = result["rows"], result["chance"]
    floor = rows["random"]
    assert floor["success"] == 0.0  # random actions never finish a pick-and-place in 12 cycles
    # exact-match answers from random weights: at most chance plus one lucky answer
    assert floor["qa"] <= chance["qa"] + 1 / cfg.questions
    assert floor["one_hop"] <= chance["one_hop"] + 2 / cfg.memory
    assert floor["two_hop"] <= chance["two_hop"] + 2 / cfg.memory
    assert "trained" not in rows


def test_expert_closed_loop_succeeds_on_held_out_episodes():
    # the eval's own closed loop with the expert's chunk in place of the engine's
    assert closed_loop(None, EvalConfig(episodes=100)) >= 0.95


def test_cli_eval_world_writes_json(tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "world", "--weights", "", "--episodes", "1", "--questions", "3",
               "--memory", "2", "--sanity", "0", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["rows"]) == {"random", "expert"} and "date" in data
    assert "chance" in capsys.readouterr().out
    assert main(["eval", "nothing"]) == 2
    assert main(["eval", "world", "--weights", str(tmp_path / "none.safetensors")]) == 2
    assert main(["eval", "world", "--episodes", "-1"]) == 2
    assert main(["eval", "world", "--sanity", "-1"]) == 2
    assert main(["train", "--steps", "-3"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sanity_rows_unified_isolated_and_restored_runs_agree_byte_for_byte():
    cfg = EvalConfig(episodes=2, questions=2, memory=2, sanity=2)
    rows = run("", "", cfg, oracle=False)["rows"]["random"]["sanity"]
    assert set(rows) == {"unified_vs_isolated", "restore_vs_never"}
    for row in rows.values():
        assert row["exact"], row
        assert row["chunks"] == row["chunks_equal"] == 2 * cfg.max_cycles  # random: no success
        assert row["answers"] == row["answers_equal"] == 4


def test_ar_mode_acts_with_bins_tokens_through_the_pipeline():
    cfg = EvalConfig(episodes=1, questions=1, memory=1, sanity=1, action_mode="ar", max_cycles=2)
    result = run("", "", cfg, oracle=False)
    row = result["rows"]["random"]
    assert result["config"]["action_mode"] == "ar" and row["success"] == 0.0
    assert row["ar_chunks"] >= cfg.max_cycles and 0 <= row["ar_invalid"] <= row["ar_chunks"]
    assert set(row["sanity"]) == {"unified_vs_separate", "restore_vs_never"}
    assert all(r["exact"] and r["chunks"] == 2 for r in row["sanity"].values()), row["sanity"]


def test_accuracies_take_an_engine_as_its_runner():
    from embodied_kv.eval.runners import EngineRunner
    from embodied_kv.eval.world import make_engine, question_accuracy, random_model
    from embodied_kv.model.trained import world_config

    cfg = EvalConfig(episodes=0, questions=3, memory=0)
    engine = make_engine(random_model(world_config()), cfg)
    assert question_accuracy(engine, cfg) == question_accuracy(EngineRunner(engine), cfg)


class _Still:
    """A runner whose chunks hold the arm where it is: never leaves the approach."""

    def begin(self):
        pass

    def act(self, scene, instruction, cycle):
        a = scene.arm
        return np.array([[a.x, a.y, a.z, -1.0, 0, 0, 0, 0]] * 5)


def test_closed_loop_reports_errors_by_stage_and_where_episodes_were_stuck(capsys):
    cfg = EvalConfig(episodes=4)
    expert = closed_loop_stages(None, cfg)
    assert expert["success"] == 1.0 and not any(k.startswith("stuck_") for k in expert)
    # a release is one step inside a chunk: a cycle rarely begins there
    assert {"err_approach", "err_carry"} <= {k for k in expert if k.startswith("err_")}
    assert all(expert.get(f"err_{s}", 0.0) == 0.0 for s in STAGE_ORDER)
    still = closed_loop_stages(_Still(), cfg)
    assert still["success"] == 0.0 and still["stuck_approach"] == 4
    assert set(still) == {"success", "err_approach", "stuck_approach"}
    assert still["err_approach"] > 0.3  # the targets lie away from the start pose
    print_stages({"still": still})
    assert "still: first-action xy error by stage: approach" in capsys.readouterr().out


class _Reader:
    """Answers "where is the X ?" from the scene itself (or always `fixed`)."""

    def __init__(self, fixed: str = ""):
        self.fixed, self.answers = fixed, []

    def begin(self):
        pass

    def submit(self, scene, instruction, text, kind):
        m = re.match(r"where is the (\w+ \w+) \?", text)
        self.answers.append(self.fixed or (where_word(scene.get(m.group(1)).x) if m else ""))
        return str(len(self.answers) - 1)

    def finish(self, request_id):
        return self.answers[int(request_id)]


def test_where_questions_are_scored_beside_qa():
    cfg = EvalConfig(questions=30)
    assert where_accuracy(_Reader(), cfg) >= 0.9  # a few scenes fall back to a left-of
    assert where_accuracy(_Reader("middle"), cfg) < 0.7  # the answers are not all one word
