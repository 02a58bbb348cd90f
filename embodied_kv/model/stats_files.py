"""Normalisation statistics as LeRobot and openpi save them; json and safetensors only.

LeRobot (`PolicyProcessorPipeline.save_pretrained`, processor/pipeline.py), a policy dir:

    policy_preprocessor.json   {"name", "steps": [{"registry_name", "config", "state_file"?}]}
      step "normalizer_processor": config {"eps", "features": {key: {"type", "shape"}},
        "norm_map": {"STATE": "QUANTILES", ...}}, state_file
        policy_preprocessor_step_<i>_normalizer_processor.safetensors with flat keys
        "<feature>.<stat>" (`_NormalizationMixin.state_dict`): observation.state.q01, ...
      step "relative_actions_processor" (optional): config {"enabled", "exclude_joints",
        "action_names"} -> the delta mask (`RelativeActionsProcessorStep._build_mask`)
    policy_postprocessor.json  step "unnormalizer_processor": the same for `action`

openpi (its `openpi/shared/normalize.py`), checkpoint_dir/assets/<asset_id>/norm_stats.json:

    {"norm_stats": {"state": {"mean", "std", "q01", "q99"}, "actions": {...}}}

    pi0.5 trains with quantile normalisation (`DataConfig.use_quantile_norm`, true for
    every model but pi0); the file does not say, so the YAML may (norm_mode).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from embodied_kv.model.normalize import LEROBOT_EPS, FeatureNorm, NormMode

STATE_KEY, ACTION_KEY = "observation.state", "action"  # LeRobot OBS_STATE, ACTION
OPENPI_STATE, OPENPI_ACTIONS = "state", "actions"
PRE, POST = "policy_preprocessor", "policy_postprocessor"  # LeRobot default pipeline names


@dataclass(frozen=True, eq=False)
class CheckpointStats:
    state: FeatureNorm
    action: FeatureNorm
    delta_mask: tuple[bool, ...] | None  # None: the files say nothing about deltas
    layout: str  # "lerobot" | "openpi"
    files: tuple[str, ...]  # what was read, for the configure log


def find_stats(path: str | Path, norm_mode: str = "", asset_id: str = "") -> CheckpointStats | None:
    """Statistics of a checkpoint (dir or file) or of a stats path given on its own.

    None when the path holds none and does not look like it should (a bare weights
    file, a folder of safetensors only); ValueError naming the file when a checkpoint
    declares statistics that are missing or inconsistent."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist")
    if p.is_file():
        if p.name.startswith((PRE, POST)) and p.suffix == ".json":
            return read_lerobot(p.parent)
        if p.suffix == ".json":
            return read_openpi(p, norm_mode)
        return None  # a bare weights file carries no statistics
    if list(p.glob(f"{PRE}*.json")) or list(p.glob(f"{POST}*.json")):
        return read_lerobot(p)
    if (p / "norm_stats.json").is_file():
        return read_openpi(p / "norm_stats.json", norm_mode)
    if (p / "assets").is_dir() or p.name == "assets":
        assets = p if p.name == "assets" else p / "assets"
        return read_openpi(openpi_stats_file(assets, asset_id), norm_mode)
    if (p / "params").is_dir():
        raise ValueError(f"{p}: openpi checkpoint (params/) without assets/<id>/norm_stats.json")
    if (p / "config.json").is_file() and _is_lerobot_policy(p / "config.json"):
        raise ValueError(
            f"{p}: a LeRobot policy without {PRE}.json / {POST}.json (the normalisation "
            "statistics); save it with LeRobot >= 0.4 or give robot.norm_stats"
        )
    return None


# -- LeRobot -------------------------------------------------------------------------------


def read_lerobot(folder: Path) -> CheckpointStats:
    pre_file, pre = _pipeline(folder, PRE)
    post_file, post = _pipeline(folder, POST)
    norm_step = _step(pre, pre_file, "normalizer_processor")
    unnorm_step = _step(post, post_file, "unnormalizer_processor")
    state = _lerobot_feature(folder, pre_file, norm_step, STATE_KEY, "STATE")
    action = _lerobot_feature(folder, post_file, unnorm_step, ACTION_KEY, "ACTION")
    mask = None
    for step in pre.get("steps", []):
        if step.get("registry_name") == "relative_actions_processor":
            dim = _feature_dim(norm_step, ACTION_KEY, pre_file)
            mask = _relative_mask(step.get("config", {}), dim)
    files = [pre_file, post_file] + [
        folder / s["state_file"] for s in (norm_step, unnorm_step) if s.get("state_file")
    ]
    return CheckpointStats(state, action, mask, "lerobot", tuple(str(f) for f in files))


def _is_lerobot_policy(config: Path) -> bool:
    try:
        return json.loads(config.read_text()).get("type") in ("pi05", "pi0")
    except (ValueError, AttributeError):
        return False


def _pipeline(folder: Path, name: str) -> tuple[Path, dict]:
    exact = folder / f"{name}.json"
    found = [exact] if exact.is_file() else sorted(folder.glob(f"{name}*.json"))
    if not found:
        raise ValueError(f"{folder}: {name}.json is missing (LeRobot processor pipeline)")
    if len(found) > 1:
        raise ValueError(f"{folder}: several {name}*.json {[f.name for f in found]}; keep one")
    try:
        data = json.loads(found[0].read_text())
    except ValueError as e:
        raise ValueError(f"{found[0]}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError(f"{found[0]}: no 'steps' list (not a LeRobot processor pipeline)")
    return found[0], data


def _step(pipeline: dict, file: Path, registry_name: str) -> dict:
    steps = [s for s in pipeline["steps"] if s.get("registry_name") == registry_name]
    if len(steps) != 1:
        raise ValueError(f"{file}: {len(steps)} '{registry_name}' steps, expected 1")
    return steps[0]


def _feature_dim(step: dict, key: str, file: Path) -> int:
    feature = step.get("config", {}).get("features", {}).get(key)
    if feature is None:
        raise ValueError(f"{file}: the {step['registry_name']} step has no feature {key!r}")
    shape = feature.get("shape", [])
    if len(shape) != 1:
        raise ValueError(f"{file}: feature {key!r} has shape {shape}, expected a vector")
    return int(shape[0])


def _lerobot_feature(folder: Path, file: Path, step: dict, key: str, ftype: str) -> FeatureNorm:
    config = step.get("config", {})
    dim = _feature_dim(step, key, file)
    if config["features"][key].get("type") != ftype:
        raise ValueError(f"{file}: feature {key!r} has type {config['features'][key].get('type')}")
    try:
        mode = NormMode(config.get("norm_map", {}).get(ftype, "IDENTITY"))
    except ValueError:
        raise ValueError(f"{file}: unknown normalisation mode for {ftype}") from None
    if mode is NormMode.IDENTITY:
        return FeatureNorm(mode, source=f"{file} ({key}: IDENTITY)")
    state_file = step.get("state_file")
    if not state_file:
        raise ValueError(f"{file}: {ftype} is {mode.value} but the step names no state_file")
    path = folder / state_file
    if not path.is_file():
        raise ValueError(f"{path} is missing (statistics named by {file.name})")
    stats: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="np") as h:
        for flat in h.keys():  # noqa: SIM118 (safe_open handles are not mappings)
            feature, _, stat = flat.rpartition(".")
            if feature == key:
                stats[stat] = h.get_tensor(flat)
    source = f"{path} ({key}: {mode.value})"
    norm = FeatureNorm(mode, stats, "lerobot", float(config.get("eps", LEROBOT_EPS)), source)
    if norm.dim != dim:
        raise ValueError(f"{source}: statistics of {norm.dim} dims, {file.name} declares {dim}")
    return norm


def _relative_mask(config: dict, action_dim: int) -> tuple[bool, ...] | None:
    """LeRobot `RelativeActionsProcessorStep._build_mask` (a joint is excluded when an
    exclude token equals or is contained in its lower-cased name)."""
    if not config.get("enabled", False):
        return None
    tokens = [str(t).lower() for t in config.get("exclude_joints") or [] if t]
    names = config.get("action_names")
    if not tokens or names is None:
        return (True,) * action_dim
    mask = [not any(t == str(n).lower() or t in str(n).lower() for t in tokens)
            for n in names[:action_dim]]  # fmt: skip
    return tuple(mask + [True] * (action_dim - len(mask)))


# -- openpi --------------------------------------------------------------------------------


def openpi_stats_file(assets: Path, asset_id: str) -> Path:
    """assets/<asset_id>/norm_stats.json (asset ids may hold a '/', e.g. org/dataset)."""
    if asset_id:
        path = assets / asset_id / "norm_stats.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing (robot.asset_id={asset_id!r})")
        return path
    found = sorted(assets.rglob("norm_stats.json"))
    if not found:
        raise ValueError(f"{assets}: no <asset_id>/norm_stats.json inside (openpi checkpoint)")
    if len(found) > 1:
        ids = [str(f.parent.relative_to(assets)) for f in found]
        raise ValueError(f"{assets}: several assets {ids}; choose one with robot.asset_id")
    return found[0]


def read_openpi(path: Path, norm_mode: str = "") -> CheckpointStats:
    modes = {"": NormMode.QUANTILES, "quantiles": NormMode.QUANTILES, "mean_std": NormMode.MEAN_STD}
    if norm_mode not in modes:
        raise ValueError(f"norm_mode {norm_mode!r}: openpi uses 'quantiles' (pi0.5) or 'mean_std'")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    stats = data.get("norm_stats") if isinstance(data, dict) else None
    if not isinstance(stats, dict):
        raise ValueError(f"{path}: no 'norm_stats' mapping (openpi norm_stats.json)")
    features = []
    for key in (OPENPI_STATE, OPENPI_ACTIONS):
        if not isinstance(stats.get(key), dict):
            raise ValueError(f"{path}: norm_stats has no {key!r} (has {sorted(stats)})")
        values = {k: v for k, v in stats[key].items() if v is not None}
        mode = modes[norm_mode]
        features.append(FeatureNorm(mode, values, "openpi", source=f"{path} ({key}: {mode.value})"))
    return CheckpointStats(features[0], features[1], None, "openpi", (str(path),))
