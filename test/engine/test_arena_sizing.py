"""max_len: 0 (auto) sizes the arena for the preset; a value too small is refused at
construction with the number needed, before any weight is built."""

import pytest

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.engine.policy import LoopConfig, arena_rows_needed
from embodied_kv.kv.manager import TaskKind
from embodied_kv.model.config import get_preset
from embodied_kv.model.synthetic import synthetic_observation


def test_pi05_needs_cameras_prompt_question_and_budgets():
    pi05 = get_preset("pi05")
    # 3 x 256 image tokens + 200 prompt + 200 question + 48 answer + 1 -> 1217 -> 1280
    assert arena_rows_needed(pi05, LoopConfig(narration_tokens=32, answer_tokens=48)) == 1280
    assert arena_rows_needed(get_preset("tiny"), LoopConfig(answer_tokens=48)) == 320


def test_auto_is_the_default_and_fits_the_longest_answer(tiny_model):
    engine = Engine(EngineConfig(control_hz=0.01, max_decode_steps=0), model=tiny_model)
    assert engine.cfg.max_len == 0
    assert engine.manager.arena.spec.max_len == 320
    m = tiny_model
    engine.observe(synthetic_observation(m.cfg, 0, "x" * 500))  # prompt cut to 96 tokens
    fp = engine.manager.prefill_frame(0, m.embed_prefix(engine._obs))
    assert fp.prefix_len == m.cfg.prefix_tokens_max
    question = list(range(32, 32 + m.cfg.max_text_tokens))
    req = engine.manager.create(fp, "q", TaskKind.ANSWER, 48, question)
    assert req.max_new_tokens == 48 and req.pending == question  # nothing cut


@pytest.mark.parametrize("preset,needed", [("tiny", 320), ("pi05", 1280)])
def test_a_too_small_max_len_names_the_rows_needed(preset, needed):
    with pytest.raises(ValueError, match=f"max_len=256 is too small .* needs {needed} rows"):
        Engine(EngineConfig(preset=preset, max_len=256))  # pi05: refused before building


def test_negative_max_len_is_refused():
    with pytest.raises(ValueError, match="bad engine config"):
        EngineConfig(max_len=-64)


# Three memory segments as the demo writes them: the plan prompt is the memory as text + goal.
DEMO_MEMORY = [
    "the red block is on the left side of the table, next to the blue bowl",
    "the blue cup is upside down behind the red block, near the robot base",
    "the bowl was moved to the right edge of the table five seconds ago",
]


def _plan_with_memory(engine):
    for i, text in enumerate(DEMO_MEMORY):
        engine.update_memory(0, f"s{i}", text, max_segments=16)  # MemoryOp.ADD
    return engine.plan("put the red block in the bowl")


def test_request_tokens_sizes_the_arena_for_plans_that_carry_memory(tiny_model):
    tiny = get_preset("tiny")
    # 2 x 16 image tokens + 96 prompt + 384 request + 48 answer + 1 = 561 -> 576
    assert arena_rows_needed(tiny, LoopConfig(answer_tokens=48, request_tokens=384)) == 576
    preset_sized = Engine(EngineConfig(control_hz=0.01), model=tiny_model)
    _, refused = _plan_with_memory(preset_sized)
    assert refused is not None and "does not fit" in refused.reason  # refused, never cut
    sized = Engine(EngineConfig(control_hz=0.01, request_tokens=384), model=tiny_model)
    assert sized.manager.arena.spec.max_len == 576
    _, refused = _plan_with_memory(sized)
    assert refused is None


def test_negative_request_tokens_are_refused():
    with pytest.raises(ValueError, match="request_tokens=-1"):
        LoopConfig(request_tokens=-1)
