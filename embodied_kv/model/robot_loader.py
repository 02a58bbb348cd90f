"""From a checkpoint path and the robot's YAML block to the RobotIO the engine applies.

`weights:` may be a LeRobot policy directory, an openpi checkpoint directory (with a
PyTorch `model.safetensors`) or a bare `.safetensors`; the statistics come from the
directory (stats_files.py) unless `robot.norm_stats` names others. Dimensions: the
statistics give the robot's state and action sizes; the YAML may state them (then
they must agree: LeRobot exactly, openpi at most the statistics' length, which
openpi slices). Without statistics: identity, the model's sizes unless the YAML says.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from embodied_kv.model.action_space import RobotIO, parse_mask
from embodied_kv.model.stats_files import CheckpointStats, find_stats

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class RobotSpec:
    """The robot block of the YAML (engine/params.py reads it)."""

    state_dim: int = 0  # robot state values; 0 = from the statistics, else the model's
    action_dim: int = 0  # commands per tick; 0 = from the statistics, else the model's
    delta_mask: str = ""  # make_bool_mask counts "6,-1"; "none"; "" = the checkpoint's
    norm_stats: str = ""  # statistics path overriding the checkpoint's; "" = the checkpoint's
    norm_mode: str = ""  # openpi norm_stats.json: "quantiles" (pi0.5, default) | "mean_std"
    asset_id: str = ""  # openpi: which assets/<asset_id>/norm_stats.json

    def __post_init__(self):
        if self.state_dim < 0 or self.action_dim < 0:
            raise ValueError(f"robot state_dim={self.state_dim}, action_dim={self.action_dim}")
        parse_mask(self.delta_mask)  # ValueError early, with the text


def load_robot_io(
    spec: RobotSpec, weights: str, model_state_dim: int, model_action_dim: int
) -> RobotIO:
    """ValueError naming the file or the YAML key when something does not fit."""
    source = spec.norm_stats or weights
    stats = find_stats(source, spec.norm_mode, spec.asset_id) if source else None
    if spec.norm_stats and stats is None:
        raise ValueError(f"robot.norm_stats={spec.norm_stats!r} holds no statistics")
    state_dim = _dim("state_dim", spec.state_dim, stats, stats and stats.state, model_state_dim)
    action_dim = _dim(
        "action_dim", spec.action_dim, stats, stats and stats.action, model_action_dim
    )
    mask = parse_mask(spec.delta_mask)
    if mask is None:
        mask = (stats.delta_mask if stats is not None else None) or ()
    if stats is None:
        why = f"no statistics in {source}" if source else "random weights have no statistics"
        io = RobotIO(state_dim, action_dim, delta_mask=mask, source=f"identity: {why}")
    else:
        io = RobotIO(
            state_dim,
            action_dim,
            stats.state.first(state_dim),
            stats.action.first(action_dim),
            mask,
            f"{stats.layout}: state {stats.state.mode.value}, actions {stats.action.mode.value} "
            f"from {', '.join(stats.files)}",
        )
    io.check_model(model_state_dim, model_action_dim)
    return io


def _dim(name: str, asked: int, stats: CheckpointStats | None, norm, model: int) -> int:
    have = None if norm is None else norm.dim
    if have is None:
        return asked or model
    if asked and (asked > have or (stats.layout == "lerobot" and asked != have)):
        raise ValueError(f"robot.{name}={asked} does not fit {norm.source}: {have} dims")
    return asked or have


def find_tokenizer(weights: str) -> str | None:
    """A tokenizer saved in the checkpoint dir (itself or its tokenizer/), if any."""
    if not weights:
        return None
    folder = Path(weights)
    if not folder.is_dir():
        return None
    for cand in (folder, folder / "tokenizer"):
        if any((cand / f).is_file() for f in TOKENIZER_FILES):
            return str(cand)
    return None
