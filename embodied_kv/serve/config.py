"""ServeConfig, and the engine's config for serving, from the robot's config file.

The engine is built exactly as the robot builds it (engine/params.py over the `/**`
section of config/robot.yaml), with two changes a server needs: no narration (nobody
subscribes to it; a frame's question is answered instead) and no per-cycle history
(rollback by steps belongs to one timeline; clients name their snapshots).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from embodied_kv.config_file import RobotParams
from embodied_kv.engine.config import EngineConfig
from embodied_kv.engine.params import ENGINE_PARAMS, engine_config
from embodied_kv.serve.layouts import LAYOUTS

SECTION = "serve"  # its section in the config file, beside the ROS nodes'


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # openpi serve_policy.py binds 0.0.0.0; we default to local
    port: int = 8000  # openpi serve_policy.py: --port 8000
    layout: str = "libero"  # libero | droid | aloha (serve/layouts.py)
    max_frame_bytes: int = 32 << 20  # larger frames close the connection (websockets max_size)
    max_prompt_chars: int = 400  # as the robot's prefill max_instruction_chars

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"serve layout {self.layout!r}: use one of {sorted(LAYOUTS)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"serve port {self.port} outside 0..65535 (0: any free port)")
        if self.max_frame_bytes < 1 << 10 or self.max_prompt_chars < 1:
            raise ValueError(f"max_frame_bytes={self.max_frame_bytes} (>= 1 KiB) and "
                             f"max_prompt_chars={self.max_prompt_chars} (>= 1)")  # fmt: skip


SERVE_KEYS = tuple(f.name for f in dataclasses.fields(ServeConfig))


def serve_config(params: RobotParams, **overrides) -> ServeConfig:
    """The `serve` section of the file; `overrides` (None skipped) win. ValueError on a
    key ServeConfig does not have or a value of the wrong type."""
    section = params.per_node.get(SECTION, {})
    unknown = sorted(set(section) - set(SERVE_KEYS))
    if unknown:
        raise ValueError(f"{params.path}: serve has no parameter {unknown}; known {SERVE_KEYS}")
    values = {**section, **{k: v for k, v in overrides.items() if v is not None}}
    for f in dataclasses.fields(ServeConfig):
        if f.name in values and type(values[f.name]) is not type(f.default):
            raise ValueError(
                f"serve {f.name}={values[f.name]!r} must be {type(f.default).__name__}"
            )
    return ServeConfig(**values)


def serve_engine_config(params: RobotParams) -> EngineConfig:
    """The robot's EngineConfig (the `/**` section) with narration and history off."""
    values = {spec.name: spec.default for spec in ENGINE_PARAMS} | params.common
    cfg = engine_config(lambda name: values[name])
    if cfg.action_mode != "flow":
        raise ValueError(f"action_mode={cfg.action_mode!r}: serve answers with the action "
                         "expert's chunk (flow); `ar` chunks arrive frames later")  # fmt: skip
    return dataclasses.replace(cfg, narrate_every=0, history=0)
