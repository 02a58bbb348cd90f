"""Reading config/*.yaml, the ROS 2 parameter file that drives launch, demo and serve.

YAML is parsed here, for the two edges (ros/ and serve/), and nowhere below them
(STYLE 4): the engine and everything under it take the frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PACKAGE = "embodied_kv"
WILDCARD = "/**"  # ROS 2 parameter files: a section that applies to every node
CONFIG_NAME = "robot.yaml"


@dataclass(frozen=True)
class RobotParams:
    """Parameters of one config file: `/**` defaults plus per-node sections."""

    path: Path
    common: dict[str, Any] = field(default_factory=dict)
    per_node: dict[str, dict[str, Any]] = field(default_factory=dict)

    def for_node(self, node_name: str) -> dict[str, Any]:
        """The parameters `node_name` sees: its own section over `/**`."""
        return {**self.common, **self.per_node.get(node_name, {})}

    def with_overrides(self, **values: Any) -> RobotParams:
        """A copy where `values` (None entries skipped) override every node's value."""
        common = {**self.common, **{k: v for k, v in values.items() if v is not None}}
        per_node = {
            node: {k: v for k, v in section.items() if values.get(k) is None}
            for node, section in self.per_node.items()
        }
        return RobotParams(self.path, common, per_node)


def load_params(path: str | Path) -> RobotParams:
    """Parse a ROS 2 parameter file; ValueError (with the path) if it is not one."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping of node names, got {data!r}")
    common: dict[str, Any] = {}
    per_node: dict[str, dict[str, Any]] = {}
    for key, section in data.items():
        values = section.get("ros__parameters") if isinstance(section, dict) else None
        if not isinstance(values, dict):
            raise ValueError(f"config {path}: section {key!r} has no ros__parameters mapping")
        name = str(key).lstrip("/")
        if key == WILDCARD:
            common.update(flatten(values))
        else:
            per_node[name] = flatten(values)
    return RobotParams(path, common, per_node)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings become dotted names, as ROS 2 parameter files define them:
    `capsules: {gpu_bytes: 1}` is the parameter `capsules.gpu_bytes`."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def default_config_path() -> Path:
    """config/robot.yaml of the source tree, else of the installed package share."""
    source_tree = Path(__file__).resolve().parents[1] / "config" / CONFIG_NAME
    if source_tree.is_file():
        return source_tree
    try:
        from ament_index_python.packages import get_package_share_directory
    except ImportError:
        get_package_share_directory = None
    if get_package_share_directory is not None:
        try:
            return Path(get_package_share_directory(PACKAGE)) / "config" / CONFIG_NAME
        except LookupError:  # PackageNotFoundError subclasses KeyError
            pass
    raise ValueError(
        f"no {CONFIG_NAME}: not at {source_tree} and package {PACKAGE} is not installed; "
        "pass --config"
    )
