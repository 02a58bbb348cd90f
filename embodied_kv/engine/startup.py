"""An engine ready for its first cycle, as every process builds it (the robot's
EngineHost, `embodied-kv serve`): weights, the KV arena, warmup (and on CUDA the
graph capture) on a synthetic observation, then the pinned `episode_start` capsule."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from embodied_kv.engine.config import EngineConfig
from embodied_kv.engine.engine import Engine
from embodied_kv.model.synthetic import synthetic_observation


def start_engine(cfg: EngineConfig, progress: Callable[[str], None]) -> Engine:
    progress(
        f"building the engine: preset {cfg.preset} on {cfg.device}, "
        f"{'weights ' + cfg.weights if cfg.weights else 'the preset default weights'} ..."
    )
    engine = Engine(cfg)
    progress(f"weights: {engine.source.label}")
    robot = engine.robot
    progress(f"robot: {robot.describe()}")
    arena = engine.manager.arena
    progress(
        f"KV arena allocated: {cfg.num_slots} slots x {arena.spec.max_len} rows, "
        f"{arena.spec.bytes / 2**20:.1f} MiB; warming up"
        f"{' and capturing CUDA graphs' if engine.graphs is not None else ''} ..."
    )
    warm = synthetic_observation(engine.model.cfg, cfg.seed, "warm up")
    engine.observe(dataclasses.replace(warm, state=np.zeros(robot.state_dim)))
    engine.warmup()
    engine.begin_episode()  # the pinned `episode_start` capsule: what `reset` restores
    return engine
