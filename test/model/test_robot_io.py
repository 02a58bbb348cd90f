"""From a checkpoint directory to robot units: statistics, normalisation, action space.

Checkpoint dirs are written here in the LeRobot (processor pipeline files) and openpi
(assets/<id>/norm_stats.json) layouts; the expected values come from the references'
formulas, written out below with the upstream function they copy."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from embodied_kv.engine.engine import Engine, EngineConfig
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.model.action_space import RobotIO, make_bool_mask, parse_mask
from embodied_kv.model.config import get_preset
from embodied_kv.model.normalize import FeatureNorm, NormMode
from embodied_kv.model.robot_loader import RobotSpec, find_tokenizer, load_robot_io
from embodied_kv.model.stats_files import find_stats
from embodied_kv.model.vla import Observation

S, A = 6, 5  # the robot: 6 state values, 5 commands (the tiny model has 8 / 8)
FP32_RTOL = 1e-6  # round trip robot -> model -> robot in float32


# -- the references' formulas ---------------------------------------------------------------


def lerobot_apply(x, stats, mode: str, eps: float = 1e-8, inverse: bool = False) -> torch.Tensor:
    """LeRobot `_NormalizationMixin._apply_transform` (processor/normalize_processor.py)."""
    t = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    st = {k: torch.as_tensor(np.asarray(v), dtype=torch.float32) for k, v in stats.items()}
    if mode == "MEAN_STD":
        mean, std = st["mean"], st["std"]
        return t * std + mean if inverse else (t - mean) / (std + eps)
    lo, hi = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
              "QUANTILE10": ("q10", "q90")}[mode]  # fmt: skip
    denom = st[hi] - st[lo]
    denom = torch.where(denom == 0, torch.tensor(eps, dtype=torch.float32), denom)
    if mode == "MIN_MAX":
        return (t + 1) / 2 * denom + st[lo] if inverse else 2 * (t - st[lo]) / denom - 1
    return (t + 1.0) * denom / 2.0 + st[lo] if inverse else 2.0 * (t - st[lo]) / denom - 1.0


def openpi_normalize_quantile(x, st):
    """openpi `Normalize._normalize_quantile` (statistics sliced to the data)."""
    q01, q99 = st["q01"][..., : x.shape[-1]], st["q99"][..., : x.shape[-1]]
    return (x - q01) / (q99 - q01 + 1e-6) * 2.0 - 1.0


def openpi_unnormalize_quantile(x, st):
    """openpi `Unnormalize._unnormalize_quantile` (dims past the statistics pass through)."""
    q01, q99 = st["q01"], st["q99"]
    if (dim := q01.shape[-1]) < x.shape[-1]:
        head = (x[..., :dim] + 1.0) / 2.0 * (q99 - q01 + 1e-6) + q01
        return np.concatenate([head, x[..., dim:]], axis=-1)
    return (x + 1.0) / 2.0 * (q99 - q01 + 1e-6) + q01


def absolute_actions(actions, state, mask):
    """openpi `AbsoluteActions` (= LeRobot `to_absolute_actions`)."""
    actions = actions.copy()
    dims = len(mask)
    actions[..., :dims] += np.expand_dims(np.where(mask, state[..., :dims], 0), axis=-2)
    return actions


# -- helpers --------------------------------------------------------------------------------


def robot_observation(cfg, state, seed: int = 5) -> Observation:
    g = torch.Generator().manual_seed(seed)
    s = cfg.vision.image_size
    images = torch.rand(cfg.num_cameras, 3, s, s, generator=g) * 2 - 1
    return Observation(images, np.asarray(state, dtype=np.float64), "pick up the cube")


def direct_chunk(model, obs: Observation, seed: int) -> np.ndarray:
    """The model's own chunk [H, 32-or-8] for an observation already in model units."""
    arena = model.new_arena(1, 512)
    slot = arena.allocate()
    prefix = model.embed_prefix(obs)
    model.prefill(arena, slot, prefix)
    noise = model.make_noise(seed)
    return model.sample_actions(arena, slot, prefix.embeds.shape[0], noise).float().numpy()


@pytest.fixture(scope="module")
def source():
    from embodied_kv.model.vla import build_model

    return build_model(get_preset("tiny", seed=3))


# -- LeRobot ----------------------------------------------------------------------------------


def test_lerobot_policy_dir_state_in_and_actions_out_in_robot_units(
    tmp_path, source, checkpoint_writers
):
    write_lerobot, _, make_stats = checkpoint_writers
    state_stats, action_stats = make_stats(S, 1, 2.0), make_stats(A, 2, 0.5)
    folder = write_lerobot(tmp_path / "policy", source, state_stats, action_stats)
    engine = Engine(EngineConfig(weights=str(folder)))
    assert (engine.robot.state_dim, engine.robot.action_dim) == (S, A)
    assert "policy_preprocessor_step_3_normalizer_processor.safetensors" in engine.robot.source

    raw = np.random.default_rng(0).uniform(-2, 2, S)
    obs = robot_observation(engine.model.cfg, raw)
    engine.observe(obs)
    expected_state = lerobot_apply(raw, state_stats, "QUANTILES").numpy()
    assert np.array_equal(engine._obs.state, expected_state.astype(np.float64))

    result = engine.cycle(0)
    model_obs = Observation(obs.images, expected_state.astype(np.float64), obs.instruction)
    chunk = direct_chunk(engine.model, model_obs, seed=0)  # [H, 8] normalised
    expected = lerobot_apply(chunk[:, :A], action_stats, "QUANTILES", inverse=True).numpy()
    assert result.chunk.shape == (engine.model.cfg.action_horizon, A)  # the robot's dims only
    assert np.array_equal(result.chunk, expected.astype(np.float64))
    tick0, _ = engine.queue.pop(0)
    assert tick0.shape == (A,) and np.array_equal(tick0, result.chunk[0])


@pytest.mark.parametrize("mode", ["MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10", "IDENTITY"])
def test_lerobot_modes_as_declared_and_round_trip(tmp_path, source, checkpoint_writers, mode):
    write_lerobot, _, make_stats = checkpoint_writers
    state_stats, action_stats = make_stats(S, 3), make_stats(A, 4)
    folder = write_lerobot(tmp_path / "p", source, state_stats, action_stats, (mode, mode))
    stats = find_stats(folder)
    assert stats.state.mode is NormMode(mode) and stats.layout == "lerobot"
    x = np.random.default_rng(1).normal(0, 1, (4, S))
    got = stats.state.normalize(x)
    if mode == "IDENTITY":
        assert np.array_equal(got, x)
    else:
        assert np.array_equal(got, lerobot_apply(x, state_stats, mode).numpy())
    y = np.random.default_rng(2).uniform(-1, 1, (10, A))
    back = stats.action.unnormalize(y)
    if mode != "IDENTITY":
        assert np.array_equal(back, lerobot_apply(y, action_stats, mode, inverse=True).numpy())
    assert np.allclose(stats.action.normalize(back), y, rtol=0, atol=1e-5)  # fp32 round trip
    assert np.allclose(stats.state.unnormalize(got), x, rtol=FP32_RTOL, atol=1e-6)


def test_lerobot_relative_actions_become_absolute_with_the_raw_state(
    tmp_path, source, checkpoint_writers
):
    write_lerobot, _, make_stats = checkpoint_writers
    names = ["j1", "j2", "j3", "j4", "gripper"]
    relative = {"enabled": True, "exclude_joints": ["gripper"], "action_names": names}
    state_stats, action_stats = make_stats(S, 5), make_stats(A, 6, 0.1)
    folder = write_lerobot(tmp_path / "rel", source, state_stats, action_stats, relative=relative)
    engine = Engine(EngineConfig(weights=str(folder)))
    assert engine.robot.delta_mask == (True, True, True, True, False)
    raw = np.random.default_rng(3).uniform(-1, 1, S)
    obs = robot_observation(engine.model.cfg, raw, seed=8)
    engine.observe(obs)
    result = engine.cycle(0)
    norm_state = lerobot_apply(raw, state_stats, "QUANTILES").numpy().astype(np.float64)
    chunk = direct_chunk(engine.model, Observation(obs.images, norm_state, obs.instruction), 0)
    unnorm = lerobot_apply(chunk[:, :A], action_stats, "QUANTILES", inverse=True).numpy()
    mask = np.array([True, True, True, True, False])  # _build_mask: "gripper" excluded
    expected = absolute_actions(unnorm.astype(np.float64), raw, mask)
    assert np.allclose(result.chunk, expected, rtol=0, atol=1e-6)
    assert np.array_equal(result.chunk[:, 4], unnorm[:, 4].astype(np.float64))  # gripper absolute


# -- openpi -----------------------------------------------------------------------------------


def test_openpi_checkpoint_quantiles_sliced_stats_and_yaml_delta_mask(
    tmp_path, source, checkpoint_writers
):
    _, write_openpi, make_stats = checkpoint_writers
    # statistics of 8 dims (computed on padded data, as some openpi configs do); robot 6 / 5
    stats = {"state": make_stats(8, 7), "actions": make_stats(8, 8, 0.3)}
    stats = {k: {s: v[s] for s in ("mean", "std", "q01", "q99")} for k, v in stats.items()}
    folder = write_openpi(tmp_path / "openpi", source, stats)
    spec = RobotSpec(state_dim=S, action_dim=A, delta_mask="4,-1")
    engine = Engine(EngineConfig(weights=str(folder), robot=spec))
    assert engine.robot.delta_mask == make_bool_mask(4, -1) == (True,) * 4 + (False,)
    assert "assets/trossen/norm_stats.json" in engine.robot.source

    raw = np.random.default_rng(4).uniform(-1, 1, S)
    obs = robot_observation(engine.model.cfg, raw, seed=9)
    engine.observe(obs)
    expected_state = openpi_normalize_quantile(raw, stats["state"])
    assert np.array_equal(engine._obs.state, expected_state)
    result = engine.cycle(0)
    chunk = direct_chunk(engine.model, Observation(obs.images, expected_state, obs.instruction), 0)
    # openpi: Unnormalize on the padded chunk, AbsoluteActions, then the robot's Outputs slice
    unnorm = openpi_unnormalize_quantile(chunk.astype(np.float64), stats["actions"])
    expected = absolute_actions(unnorm, raw, np.array(make_bool_mask(4, -1)))[:, :A]
    assert result.chunk.shape == (engine.model.cfg.action_horizon, A)
    assert np.allclose(result.chunk, expected, rtol=0, atol=1e-9)
    norm = engine.robot.action
    assert np.allclose(norm.normalize(norm.unnormalize(chunk[:, :A])), chunk[:, :A], atol=1e-9)


def test_openpi_mean_std_when_the_yaml_says(tmp_path, source, checkpoint_writers):
    _, write_openpi, make_stats = checkpoint_writers
    stats = {"state": make_stats(S, 9), "actions": make_stats(A, 10)}
    stats = {k: {s: v[s] for s in ("mean", "std")} for k, v in stats.items()}  # no quantiles
    folder = write_openpi(tmp_path / "o", source, stats)
    io = load_robot_io(RobotSpec(norm_mode="mean_std"), str(folder), 8, 8)
    x = np.linspace(-3, 3, S)
    mean, std = stats["state"]["mean"], stats["state"]["std"]
    assert np.array_equal(io.state_in(x), (x - mean) / (std + 1e-6))  # openpi Normalize._normalize
    y = np.linspace(-1, 1, A)
    amean, astd = stats["actions"]["mean"], stats["actions"]["std"]
    assert np.array_equal(io.actions_out(y[None], None)[0], y * (astd + 1e-6) + amean)
    quantiles_missing = r"norm_stats.json \(state: QUANTILES\).*needs \['q01', 'q99'\]"
    with pytest.raises(ValueError, match=quantiles_missing):
        load_robot_io(RobotSpec(), str(folder), 8, 8)  # pi0.5's default: quantiles


# -- what is refused at configure ----------------------------------------------------------


def test_missing_or_inconsistent_files_are_refused_naming_the_file(
    tmp_path, source, checkpoint_writers
):
    write_lerobot, write_openpi, make_stats = checkpoint_writers
    folder = write_lerobot(tmp_path / "a", source, make_stats(S, 1), make_stats(A, 2))
    state_file = folder / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    state_file.unlink()
    with pytest.raises(ValueError, match="policy_postprocessor_step_0_unnormalizer_processor"):
        Engine(EngineConfig(weights=str(folder)))

    folder = write_lerobot(tmp_path / "b", source, make_stats(S, 1), make_stats(A, 2))
    pre = json.loads((folder / "policy_preprocessor.json").read_text())
    pre["steps"][3]["config"]["features"]["observation.state"]["shape"] = [S + 1]
    (folder / "policy_preprocessor.json").write_text(json.dumps(pre))
    with pytest.raises(ValueError, match=r"normalizer_processor.safetensors.*6 dims.*declares 7"):
        Engine(EngineConfig(weights=str(folder)))

    folder = write_lerobot(tmp_path / "c", source, make_stats(S, 1), make_stats(A, 2))
    (folder / "policy_preprocessor.json").unlink()
    with pytest.raises(ValueError, match="policy_preprocessor.json is missing"):
        find_stats(folder)
    folder = write_lerobot(tmp_path / "f", source, make_stats(S, 1), make_stats(A, 2))
    with pytest.raises(ValueError, match=r"robot.action_dim=4 does not fit .*unnormalizer"):
        load_robot_io(RobotSpec(action_dim=4), str(folder), 8, 8)

    stats = {"state": make_stats(S, 1), "actions": make_stats(A, 2)}
    folder = write_openpi(tmp_path / "d", source, stats)
    (folder / "assets" / "trossen" / "norm_stats.json").unlink()
    with pytest.raises(ValueError, match="no <asset_id>/norm_stats.json"):
        Engine(EngineConfig(weights=str(folder)))
    folder = write_openpi(tmp_path / "e", source, stats, asset_id="org/aloha")
    (folder / "assets" / "trossen").mkdir()
    assets = folder / "assets"
    shutil.copy(assets / "org" / "aloha" / "norm_stats.json", assets / "trossen")
    with pytest.raises(ValueError, match=r"several assets .*robot.asset_id"):
        find_stats(folder)
    assert find_stats(folder, asset_id="org/aloha").layout == "openpi"
    assert find_stats(folder / "assets", asset_id="trossen").layout == "openpi"
    io = load_robot_io(RobotSpec(norm_stats=str(assets / "trossen")), "", 8, 8)
    assert (io.state_dim, io.action_dim) == (S, A) and "trossen/norm_stats.json" in io.source
    with pytest.raises(ValueError, match="holds no statistics"):
        load_robot_io(RobotSpec(norm_stats=str(tmp_path / "d" / "model.safetensors")), "", 8, 8)
    with pytest.raises(ValueError, match="action_dim 5 exceed the model's 8 / 4"):
        load_robot_io(RobotSpec(asset_id="trossen"), str(folder), 8, 4)  # 5 actions > 4


def test_an_openpi_jax_checkpoint_is_refused_with_the_way_out(tmp_path, checkpoint_writers):
    _, _, make_stats = checkpoint_writers
    folder = tmp_path / "jax"
    (folder / "params").mkdir(parents=True)
    (folder / "assets" / "trossen").mkdir(parents=True)
    stats = {k: {s: v.tolist() for s, v in make_stats(8, i).items()}
             for i, k in enumerate(("state", "actions"))}  # fmt: skip
    (folder / "assets" / "trossen" / "norm_stats.json").write_text(
        json.dumps({"norm_stats": stats})
    )
    with pytest.raises(ValueError, match="convert_jax_model_to_pytorch.py"):
        Engine(EngineConfig(weights=str(folder)))


def test_a_capsule_of_other_robot_units_is_another_config(tmp_path, source, checkpoint_writers):
    """The action queue in a capsule is in robot units: restoring it under other
    statistics or another delta mask is refused like any other config change."""
    write_lerobot, _, make_stats = checkpoint_writers
    folder = write_lerobot(tmp_path / "p", source, make_stats(S, 1), make_stats(A, 2))
    store = StoreConfig(disk_dir=str(tmp_path / "capsules"))
    first = Engine(EngineConfig(weights=str(folder), store=store))
    first.observe(robot_observation(first.model.cfg, np.zeros(S)))
    first.cycle(0)
    first.snapshot("mid", "disk")
    same = Engine(EngineConfig(weights=str(folder), store=store))
    same.restore("mid")  # the same robot units: fine
    assert same.queue.state_meta() == first.queue.state_meta()
    deltas = Engine(EngineConfig(weights=str(folder), store=store,
                                 robot=RobotSpec(delta_mask="2")))  # fmt: skip
    with pytest.raises(ValueError, match="taken with another config"):
        deltas.restore("mid")


def test_no_statistics_is_identity_and_says_so(tmp_path):
    io = load_robot_io(RobotSpec(), "", 8, 8)
    assert io.identity and (io.state_dim, io.action_dim) == (8, 8)
    assert "identity" in io.describe() and "random weights have no statistics" in io.describe()
    x = np.random.default_rng(0).normal(size=(3, 8))
    assert np.array_equal(io.actions_out(x, None), x)
    engine = Engine(EngineConfig())
    assert engine.robot.identity and engine.queue.action_dim == 8


def test_delta_mask_text_and_tokenizer_beside_the_weights(tmp_path):
    assert parse_mask("") is None and parse_mask("none") == ()
    expected = (True, True, False, False, True, True)  # openpi make_bool_mask docstring
    assert parse_mask("2,-2,2") == make_bool_mask(2, -2, 2) == expected
    with pytest.raises(ValueError, match="make_bool_mask counts"):
        parse_mask("six")
    with pytest.raises(ValueError, match="delta_mask has 9 entries > action_dim 8"):
        RobotIO(8, 8, delta_mask=(True,) * 9)
    with pytest.raises(ValueError, match=r"\(state: MEAN_STD\): state statistics have 3 dims"):
        RobotIO(4, 4, state=FeatureNorm(NormMode.MEAN_STD, {"mean": [0] * 3, "std": [1] * 3},
                                        source="x (state: MEAN_STD)"))  # fmt: skip
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    assert find_tokenizer(str(tmp_path)) == str(tmp_path / "tokenizer")
    assert find_tokenizer("") is None
