"""`configure` with a robot's checkpoint: a broken statistics file or joint names that do
not fit the checkpoint's action dimensions are refused, with the file or the sizes
named in the log, and the node stays unconfigured and usable."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("rclpy", reason="rclpy is not importable (`make test` installs it)")

from rclpy.lifecycle import TransitionCallbackReturn  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from embodied_kv.model.checkpoint import save_in_lerobot_layout  # noqa: E402
from embodied_kv.model.config import get_preset  # noqa: E402
from embodied_kv.model.vla import build_model  # noqa: E402
from embodied_kv.ros.action_expert import ActionExpertNode  # noqa: E402
from embodied_kv.ros.prefill import PrefillNode  # noqa: E402

STATS_FILE = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"


def lerobot_dir(folder, action_dim: int):
    """A LeRobot policy dir whose postprocessor names its stats file (written by the caller)."""
    folder.mkdir()
    save_in_lerobot_layout(build_model(get_preset("tiny")), folder / "model.safetensors")
    features = {"observation.state": {"type": "STATE", "shape": [8]},
                "action": {"type": "ACTION", "shape": [action_dim]}}  # fmt: skip
    config = {"eps": 1e-8, "features": features,
              "norm_map": {"STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}  # fmt: skip
    stats = {"observation.state.mean": np.zeros(8, np.float32),
             "observation.state.std": np.ones(8, np.float32),
             "action.mean": np.zeros(action_dim, np.float32),
             "action.std": np.ones(action_dim, np.float32)}  # fmt: skip
    pre_file = "policy_preprocessor_step_0_normalizer_processor.safetensors"
    save_file(stats, str(folder / pre_file))
    for name, step, file in (("policy_preprocessor", "normalizer_processor", pre_file),
                             ("policy_postprocessor", "unnormalizer_processor", STATS_FILE)):
        steps = [{"registry_name": step, "config": config, "state_file": file}]
        (folder / f"{name}.json").write_text(json.dumps({"name": name, "steps": steps}))
    return folder, stats  # fmt: skip


def configure(ros, node_class, overrides):
    owner = ros.participant()
    node = owner.add(node_class(context=owner.context, namespace=ros.namespace,
                                parameter_overrides=overrides))  # fmt: skip
    result = node.trigger_configure()
    return node, result


def test_missing_stats_file_is_refused_at_configure_naming_it(ros, tmp_path, capfd):
    folder, _ = lerobot_dir(tmp_path / "policy", action_dim=8)  # the stats file never written
    node, result = configure(ros, PrefillNode, [Parameter("weights", value=str(folder))])
    assert result == TransitionCallbackReturn.FAILURE and not node.configured
    err = capfd.readouterr().err
    assert f"{folder / STATS_FILE} is missing" in err and "configure failed" in err


def test_joint_names_must_match_the_checkpoints_action_dims(ros, tmp_path, capfd):
    folder, stats = lerobot_dir(tmp_path / "policy", action_dim=6)
    save_file({k: v for k, v in stats.items() if k.startswith("action.")},
              str(folder / STATS_FILE))  # fmt: skip
    joints = [f"j{i}" for i in range(8)]
    params = [Parameter("weights", value=str(folder)), Parameter("joint_names", value=joints)]
    node, result = configure(ros, ActionExpertNode, params)
    assert result == TransitionCallbackReturn.FAILURE and not node.configured
    assert "joint_names has 8 names, the robot acts on 6 dimensions" in capfd.readouterr().err
    ok, result = configure(ros, ActionExpertNode,
                           [Parameter("weights", value=str(folder)),
                            Parameter("joint_names", value=joints[:6])])  # fmt: skip
    assert result == TransitionCallbackReturn.SUCCESS and ok.engine.robot.action_dim == 6
    assert ok.engine.robot.action.mode.value == "MEAN_STD"
