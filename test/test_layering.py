"""docs/ARCHITECTURE.md: only embodied_kv/ros (and test/ros) import rclpy or message types,
and YAML is parsed only there (STYLE 4), so everything else runs without ROS."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROS_MODULES = {
    "rclpy", "rcl_interfaces", "builtin_interfaces", "std_msgs", "std_srvs", "sensor_msgs",
    "lifecycle_msgs", "trajectory_msgs", "diagnostic_msgs", "launch", "launch_ros",
    "launch_pytest", "ament_index_python", "embodied_kv.msg", "embodied_kv.srv",
}  # fmt: skip
ROS_EDGE_ONLY = {"yaml"}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_under(name: str, roots: set[str]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def offenders(folder: str, edge: str, forbidden: set[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if (ROOT / edge) in path.parents:
            continue
        bad = sorted(n for n in imported_modules(path) if is_under(n, forbidden))
        if bad:
            found.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    return found


# The one reader of the ROS 2 parameter file, shared by the ros/ and serve/ edges: YAML,
# and the installed package's share folder when there is no source tree.
PARAMETER_FILE_READER = "embodied_kv/config_file.py"
READER_MAY_IMPORT = {"yaml", "ament_index_python"}


def test_package_imports_ros_only_in_ros_layer():
    found = offenders("embodied_kv", "embodied_kv/ros", ROS_MODULES | ROS_EDGE_ONLY)
    reader = offenders("embodied_kv", "embodied_kv/ros", READER_MAY_IMPORT)
    allowed = [f for f in reader if f.startswith(PARAMETER_FILE_READER + ":")]
    assert allowed and [f for f in found if f not in allowed] == []


def test_tests_import_ros_only_in_test_ros():
    assert offenders("test", "test/ros", ROS_MODULES) == []


WORLD_ALLOWED = {"numpy", "embodied_kv.world", "__future__", "copy", "dataclasses", "re",
                 # world/visited.py's file of replays: the standard library's file handling
                 "functools", "json", "os", "pathlib", "tempfile"}  # fmt: skip


def test_world_is_numpy_only():
    """docs/ARCHITECTURE.md: world/ is the synthetic tabletop in numpy: no torch, no rclpy, nothing
    of the model or engine (so the demo's robot and any tool can use it)."""
    found = []
    for path in sorted((ROOT / "embodied_kv" / "world").rglob("*.py")):
        bad = sorted(
            n for n in imported_modules(path)
            if not any(is_under(n, {root}) for root in WORLD_ALLOWED)
        )  # fmt: skip
        if bad:
            found.append(f"{path.relative_to(ROOT)}: {', '.join(bad)}")
    assert found == []


RUNTIME = ("kernels", "storage", "kv", "model", "engine")  # what the robot runs
TOOLS = {"embodied_kv.train", "embodied_kv.bench", "embodied_kv.eval", "embodied_kv.cli",
         "embodied_kv.gpu_check", "embodied_kv.ros"}  # fmt: skip


def test_the_runtime_layers_import_no_tool_above_them():
    """docs/ARCHITECTURE.md: kernels, kv, model and engine never import training,
    benchmarks, evaluation, the CLI or the ROS layer (what the engine needs of a trained
    model's files lives in model/trained.py and model/word_tokenizer.py)."""
    found = []
    for layer in RUNTIME:
        found += offenders(f"embodied_kv/{layer}", f"embodied_kv/{layer}/__none__", TOOLS)
    assert found == []


def test_storage_sits_below_the_model_and_the_model_below_the_cache_policy():
    """docs/ARCHITECTURE.md: the arena and step plan (storage/) import neither the model nor what
    manages the arena (kv/: manager, capsules, compression, memory); the model reads and
    writes the arena (storage/) and imports nothing of kv/ or engine/."""
    above_storage = {"embodied_kv.model", "embodied_kv.kv", "embodied_kv.engine"}
    assert offenders("embodied_kv/storage", "embodied_kv/storage/__none__", above_storage) == []
    above_model = {"embodied_kv.kv", "embodied_kv.engine"}
    assert offenders("embodied_kv/model", "embodied_kv/model/__none__", above_model) == []
