"""config/*.yaml parsing (plain YAML: runs without rclpy)."""

from __future__ import annotations

import pytest

from embodied_kv.ros.params import default_config_path, load_params


def test_shipped_config_is_the_tiny_preset():
    params = load_params(default_config_path())
    assert params.for_node("prefill") == {
        "preset": "tiny",
        "control_rate_hz": 50.0,
        "autostart": True,
    }


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
