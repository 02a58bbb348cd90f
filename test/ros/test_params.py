"""config/*.yaml parsing and the engine parameters (plain YAML: runs without rclpy)."""

from __future__ import annotations

import pytest

from embodied_kv.config_file import default_config_path, load_params
from embodied_kv.engine.params import ENGINE_PARAMS, engine_config


def test_shipped_config_is_the_world_preset_at_50_hz_and_makes_an_engine_config():
    params = load_params(default_config_path())
    prefill = params.for_node("prefill")
    assert (prefill["preset"], prefill["control_rate_hz"], prefill["autostart"]) == (
        "world",
        50.0,
        True,
    )
    assert prefill["weights"] == ""  # the world preset's shipped weights
    assert prefill["cameras"] == ["top", "front"]  # the world's cameras, in training order
    assert len(params.for_node("action_expert")["joint_names"]) == 8  # world: action_dim
    defaults = {spec.name: spec.default for spec in ENGINE_PARAMS}
    cfg = engine_config(lambda name: params.for_node("kv_manager").get(name, defaults[name]))
    assert (cfg.preset, cfg.control_hz, cfg.replan_every, cfg.threads) == ("world", 50.0, 5, 1)
    assert cfg.store.disk_dir.endswith("embodied_kv/capsules") and "~" not in cfg.store.disk_dir
    assert cfg.action_mode == "flow" and cfg.ar.kind == "fast" and cfg.ar.max_tokens == 24
    assert (cfg.keep.first_ratio, cfg.keep.last_ratio, cfg.keep.hops) == (0.4, 0.1, 3)
    assert cfg.keep_min_segments == 16 and cfg.memory_mode == "full"


def test_nested_mappings_are_dotted_parameter_names(tmp_path):
    path = tmp_path / "robot.yaml"
    path.write_text("/**:\n  ros__parameters:\n    arena: {num_slots: 4, max_len: 64}\n")
    assert load_params(path).for_node("prefill") == {"arena.num_slots": 4, "arena.max_len": 64}


@pytest.mark.parametrize(
    "name,value,complaint",
    [
        ("control_rate_hz", 0, "control_rate_hz=0.0 must be > 0"),
        ("arena.num_slots", 2.5, "must be an integer"),
        ("preset", "", "preset is empty"),
        ("cuda_graphs", "yes", "must be true or false"),
        ("arena.max_len", -64, "must be auto, 0 \\(auto\\) or > 0"),
        ("action_mode", "fancy", "use 'flow' or 'ar'"),
        ("ar.tokenizer", "vq", "use 'bins' or 'fast'"),
        ("memory.keep_last_ratio", 1.5, "ratios must be in \\[0, 1\\]"),
        ("memory.keep_hops", -1, "hops >= 0"),
        ("memory.keep_min_segments", -1, "keep_min_segments=-1 must be >= 0"),
        ("memory.mode", "cached", "memory_mode='cached': use one of"),
    ],
)
def test_bad_engine_parameters_are_value_errors_naming_them(name, value, complaint):
    values = {spec.name: spec.default for spec in ENGINE_PARAMS} | {name: value}
    with pytest.raises(ValueError, match=complaint):
        engine_config(values.__getitem__)


def test_node_section_overrides_wildcard_and_cli_overrides_both(tmp_path):
    path = tmp_path / "robot.yaml"
    path.write_text(
        "/**:\n  ros__parameters:\n    preset: tiny\n    control_rate_hz: 50.0\n"
        "action_expert:\n  ros__parameters:\n    control_rate_hz: 100.0\n    preset: other\n"
    )
    params = load_params(path)
    assert params.for_node("action_expert") == {"preset": "other", "control_rate_hz": 100.0}
    assert params.for_node("prefill") == {"preset": "tiny", "control_rate_hz": 50.0}
    overridden = params.with_overrides(preset="pi05", control_rate_hz=None)
    assert overridden.for_node("action_expert") == {"preset": "pi05", "control_rate_hz": 100.0}
    assert overridden.for_node("prefill")["preset"] == "pi05"


@pytest.mark.parametrize(
    "text,complaint",
    [
        ("- a list\n", "expected a mapping"),
        ("prefill: {}\n", "no ros__parameters"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_file(tmp_path, text, complaint):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=complaint) as info:
        load_params(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("value,rows", [("auto", 0), (0, 0), (2048, 2048)])
def test_max_len_auto_or_rows(value, rows):
    values = {spec.name: spec.default for spec in ENGINE_PARAMS} | {"arena.max_len": value}
    assert engine_config(values.__getitem__).max_len == rows


def test_shipped_config_sizes_the_arena_for_pi05():
    from embodied_kv.engine.policy import LoopConfig, arena_rows
    from embodied_kv.model.config import get_preset

    params = load_params(default_config_path()).with_overrides(preset="pi05")
    defaults = {spec.name: spec.default for spec in ENGINE_PARAMS}
    cfg = engine_config(lambda name: params.for_node("prefill").get(name, defaults[name]))
    assert (cfg.preset, cfg.max_len) == ("pi05", 0)
    loop = LoopConfig(narration_tokens=cfg.narration_tokens, answer_tokens=cfg.answer_tokens)
    pi05 = get_preset("pi05")
    assert arena_rows(cfg.max_len, pi05, loop) >= pi05.prefix_tokens_max + cfg.answer_tokens


def test_robot_block_becomes_the_engines_robot_spec():
    values = {spec.name: spec.default for spec in ENGINE_PARAMS}
    cfg = engine_config(values.__getitem__)
    assert (cfg.robot.state_dim, cfg.robot.action_dim, cfg.robot.delta_mask) == (0, 0, "")
    values |= {"robot.action_dim": 7, "robot.delta_mask": "6,-1", "robot.norm_mode": "mean_std"}
    cfg = engine_config(values.__getitem__)
    robot = cfg.robot
    assert (robot.action_dim, robot.delta_mask, robot.norm_mode) == (7, "6,-1", "mean_std")
    with pytest.raises(ValueError, match="delta_mask 'six'"):
        engine_config((values | {"robot.delta_mask": "six"}).__getitem__)
    with pytest.raises(ValueError, match=r"parameter robot.state_dim=1.5 must be an integer"):
        engine_config((values | {"robot.state_dim": 1.5}).__getitem__)


def test_command_line_weights_override_the_config_for_every_node():
    pytest.importorskip("rclpy", reason="the container's argument parser lives with its rclpy")
    from embodied_kv.ros.container import parse_args

    args = parse_args(["--weights", "out/train/weights.safetensors", "--preset", "world"])
    params = load_params(default_config_path()).with_overrides(
        preset=args.preset or None, weights=args.weights or None
    )
    for node in ("prefill", "action_expert", "kv_manager"):
        assert params.for_node(node)["weights"] == "out/train/weights.safetensors"
        assert params.for_node(node)["preset"] == "world"
    assert load_params(default_config_path()).with_overrides(weights=None).common["weights"] == ""


def test_language_kv_parameters_become_the_compression_config():
    params = load_params(default_config_path())
    defaults = {spec.name: spec.default for spec in ENGINE_PARAMS}
    cfg = engine_config(lambda name: params.for_node("language_expert").get(name, defaults[name]))
    assert cfg.compress.budget == 1.0 and not cfg.compress.enabled  # shipped: off
    assert (cfg.compress.method, cfg.compress.compress_expert) == ("vlcache", False)
    values = defaults | {"language.kv_budget": 0.1, "language.kv_method": "snapkv"}
    cfg = engine_config(values.__getitem__)
    assert (cfg.compress.budget, cfg.compress.method, cfg.compress.enabled) == (0.1, "snapkv", True)
    with pytest.raises(ValueError, match="kv budget 1.5"):
        engine_config((values | {"language.kv_budget": 1.5}).__getitem__)
    with pytest.raises(ValueError, match="unknown KV compression method 'zip'"):
        engine_config((values | {"language.kv_method": "zip"}).__getitem__)
