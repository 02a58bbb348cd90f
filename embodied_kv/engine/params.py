"""The engine's parameters: declared on every ROS node (and read by `serve`), into one
EngineConfig.

They belong in the `/**` section of config/robot.yaml: the one engine of the process
is built from the parameters of the first node that configures, and a node whose
values differ refuses to configure (EngineHost.acquire says which differ). Numbers
may be written as ints or floats; they are checked here, not by rclpy's types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodied_kv.engine.engine import EngineConfig
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.kv.compress import CompressConfig
from embodied_kv.kv.memory import MemoryConfig
from embodied_kv.kv.selectors import KeepConfig
from embodied_kv.model.action_tokens import ActionTokenConfig
from embodied_kv.model.robot_loader import RobotSpec
from embodied_kv.model.rtc import RTCConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str  # ROS parameter name; dotted = a nested mapping in the YAML
    default: Any
    description: str


ENGINE_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("preset", "tiny", "model preset: world | tiny | pi05"),
    ParamSpec("device", "auto", "torch device: auto (cuda when present, else cpu) | cpu | cuda:N"),
    ParamSpec(
        "weights", "", "safetensors, LeRobot or openpi dir; '' = the preset's shipped, else random"
    ),
    ParamSpec("tokenizer", "", "pi05: PaliGemma tokenizer path; '' = the checkpoint's, else bytes"),
    ParamSpec("control_rate_hz", 50.0, "action output rate (Hz)"),
    ParamSpec("replan_every", 5, "control ticks per engine cycle: a new chunk every N actions"),
    ParamSpec("blend", 2, "ticks over which the old and the new chunk are mixed"),
    ParamSpec("seed", 0, "random weights; action noise of frame t is drawn with seed + t"),
    ParamSpec("torch_threads", 1, "torch CPU threads (1: see docs/ros.md, Real time)"),
    ParamSpec("cuda_graphs", True, "capture decode / prefill / denoise graphs on CUDA"),
    ParamSpec("arena.num_slots", 8, "KV arena slots: the frame in flight + live requests"),
    ParamSpec(
        "arena.max_len",
        "auto",
        "KV arena rows per slot (tokens); auto (or 0) = what the preset and language budgets need",
    ),
    ParamSpec("language.narrate_every", 10, "every Nth frame narrates (0: never)"),
    ParamSpec("language.narration_tokens", 32, "token budget of a narration"),
    ParamSpec("language.answer_tokens", 48, "token budget of an answer or a plan"),
    ParamSpec("language.max_decode_steps", 0, "decode steps per cycle; 0 = until the deadline"),
    ParamSpec("language.max_pending", 16, "questions + plans waiting for a slot; more: refused"),
    ParamSpec(
        "language.request_tokens",
        0,
        "longest question / plan prompt (memory + goal), tokens; sizes the arena; 0 = preset's",
    ),
    ParamSpec("language.kv_budget", 1.0, "VL-Cache: image KV rows kept by answers (1.0 = off)"),
    ParamSpec("language.kv_method", "vlcache", "KV compression method (kv/presses.py)"),
    ParamSpec("language.kv_compress_expert", False, "the action expert reads it compressed too"),
    ParamSpec("max_cycle_failures", 3, "failed engine cycles in a row before the safe state"),
    ParamSpec("capsules.gpu_bytes", 512 << 20, "capsule budget of the device tier (B)"),
    ParamSpec("capsules.host_bytes", 2 << 30, "capsule budget of the host tier (B)"),
    ParamSpec("capsules.disk_bytes", 16 << 30, "capsule budget of the disk tier (B)"),
    ParamSpec("capsules.disk_dir", "", "folder of the disk tier ('' = no disk tier; ~ expands)"),
    ParamSpec("capsules.history", 8, "per-cycle boundaries kept for rollback by steps"),
    # -- the robot's side of the model (model/robot_loader.py) --
    ParamSpec("robot.state_dim", 0, "robot state values; 0 = from the statistics, else model's"),
    ParamSpec("robot.action_dim", 0, "commands per tick; 0 = from the statistics, else model's"),
    ParamSpec(
        "robot.delta_mask",
        "",
        "delta action dims as make_bool_mask counts '6,-1'; 'none'; '' = the checkpoint's",
    ),  # fmt: skip
    ParamSpec("robot.norm_stats", "", "statistics path overriding the checkpoint's; ''"),
    ParamSpec("robot.norm_mode", "", "openpi norm_stats.json: quantiles (pi0.5) | mean_std"),
    ParamSpec("robot.asset_id", "", "openpi: assets/<asset_id>/norm_stats.json to use"),
)

# The action mode (docs/actionflow.md): `flow` = the action expert; `ar` = action tokens
# decoded by the backbone, pipelined across frames, published on the same topics.
ACTION_MODE_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("action_mode", "flow", "flow (action expert) | ar (autoregressive action tokens)"),
    ParamSpec("ar.tokenizer", "fast", "ar: bins (OpenVLA) | fast (openpi FAST)"),
    ParamSpec("ar.horizon", 10, "ar: ticks per decoded chunk (bins: K = horizon x action dims)"),
    ParamSpec("ar.max_tokens", 24, "ar fast: cap K per frame; 0 = 2 x horizon x action dims"),
    ParamSpec("ar.fast_dir", "", "ar fast: FAST tokenizer folder; '' = train one at configure"),
    ParamSpec("ar.fast_vocab", 1024, "ar fast: BPE vocabulary when trained here"),
    ParamSpec("ar.unified", True, "ar: language decodes join the pipeline's packed step"),
)
# The planner's memory (docs/keep.md): cached KV with selective recomputation, or text.
MEMORY_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("memory.mode", "full", "full (memory as text, exact) | keep (as cached KV, KEEP)"),
    ParamSpec("memory.window", 10, "KEEP t: updates without a change before a group is static"),
    ParamSpec("memory.group_threshold", 0.9, "cosine to join a group when none is given"),
    ParamSpec("memory.keep_first_ratio", 0.4, "KEEP r_1: segments recomputed at layer 1"),
    ParamSpec("memory.keep_last_ratio", 0.1, "KEEP r at the last layer (linear in between)"),
    ParamSpec("memory.keep_hops", 3, "KEEP multi-hop rounds (0: the query's attention alone)"),
    ParamSpec("memory.keep_min_segments", 16,
              "KEEP from this many memory segments; a smaller memory is prefilled whole"),
    ParamSpec("memory.keep_graphs", False, "KEEP's prefill replayed from CUDA graphs (GPU)"),
)
# Real-time chunking (docs/rtc.md): each chunk guided towards the one still executing.
RTC_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("rtc.enabled", False, "real-time chunking of the action expert's chunks (flow)"),
    ParamSpec("rtc.max_guidance", 5.0, "beta: clip of the guidance weight (paper 5, LeRobot 10)"),
    ParamSpec("rtc.execution_horizon", 0, "s: ticks a chunk runs before the next; 0 = replan"),
    ParamSpec("rtc.schedule", "exp", "W between d and H - s: exp (paper) | linear | hard"),
    ParamSpec("rtc.guidance", "vjp", "vjp (PiGDM, the paper) | error (LeRobot, no backward) | "
              "prefix (the d stale actions held: weights trained with train --prefix-max)"),
    ParamSpec("rtc.delay", "measured", "d: measured (moving estimate) | ticks, an integer"),
    ParamSpec("rtc.band", 0, "rows of W's schedule after d (0: up to H - s); prefix: guided rows"),
)
ENGINE_PARAMS = ENGINE_PARAMS + ACTION_MODE_PARAMS + MEMORY_PARAMS + RTC_PARAMS


def engine_config(get: Callable[[str], Any]) -> EngineConfig:
    """EngineConfig from parameter values (`get(name)`); ValueError naming the parameter."""
    store = StoreConfig(
        gpu_bytes=_int(get, "capsules.gpu_bytes"),
        host_bytes=_int(get, "capsules.host_bytes"),
        disk_bytes=_int(get, "capsules.disk_bytes"),
        disk_dir=_path(get, "capsules.disk_dir"),
    )
    preset = _str(get, "preset")
    if not preset:
        raise ValueError("parameter preset is empty")
    rate = _float(get, "control_rate_hz")
    if rate <= 0:
        raise ValueError(f"control_rate_hz={rate} must be > 0")
    threads = _int(get, "torch_threads")
    if threads < 1:
        raise ValueError(f"torch_threads={threads} must be >= 1")
    return EngineConfig(
        preset=preset,
        device=resolve_device(_str(get, "device")),
        weights=_str(get, "weights"),
        tokenizer=_str(get, "tokenizer"),
        num_slots=_int(get, "arena.num_slots"),
        max_len=_max_len(get),
        control_hz=rate,
        replan_every=_int(get, "replan_every"),
        blend=_int(get, "blend"),
        threads=threads,
        narrate_every=_int(get, "language.narrate_every"),
        narration_tokens=_int(get, "language.narration_tokens"),
        answer_tokens=_int(get, "language.answer_tokens"),
        max_decode_steps=_int(get, "language.max_decode_steps"),
        max_pending=_int(get, "language.max_pending"),
        request_tokens=_int(get, "language.request_tokens"),
        max_cycle_failures=_int(get, "max_cycle_failures"),
        seed=_int(get, "seed"),
        history=_int(get, "capsules.history"),
        cuda_graphs=_bool(get, "cuda_graphs"),
        store=store,
        robot=robot_spec(get),
        action_mode=_str(get, "action_mode"),
        ar=ActionTokenConfig(
            kind=_str(get, "ar.tokenizer"),
            horizon=_int(get, "ar.horizon"),
            max_tokens=_int(get, "ar.max_tokens"),
            fast_dir=_path(get, "ar.fast_dir"),
            fast_vocab=_int(get, "ar.fast_vocab"),
            seed=_int(get, "seed"),
        ),
        ar_unified=_bool(get, "ar.unified"),
        compress=CompressConfig(
            budget=_float(get, "language.kv_budget"),
            method=_str(get, "language.kv_method"),
            compress_expert=_bool(get, "language.kv_compress_expert"),
        ),
        memory_mode=_str(get, "memory.mode"),
        memory=MemoryConfig(
            window=_int(get, "memory.window"),
            group_threshold=_float(get, "memory.group_threshold"),
        ),
        keep=KeepConfig(
            first_ratio=_float(get, "memory.keep_first_ratio"),
            last_ratio=_float(get, "memory.keep_last_ratio"),
            hops=_int(get, "memory.keep_hops"),
        ),
        keep_graphs=_bool(get, "memory.keep_graphs"),
        keep_min_segments=_int(get, "memory.keep_min_segments"),
        rtc=RTCConfig(
            enabled=_bool(get, "rtc.enabled"),
            max_guidance=_float(get, "rtc.max_guidance"),
            execution_horizon=_int(get, "rtc.execution_horizon"),
            schedule=_str(get, "rtc.schedule"),
            guidance=_str(get, "rtc.guidance"),
            delay=_delay(get),
            band=_int(get, "rtc.band"),
        ),
    )


def robot_spec(get: Callable[[str], Any]) -> RobotSpec:
    return RobotSpec(
        state_dim=_int(get, "robot.state_dim"),
        action_dim=_int(get, "robot.action_dim"),
        delta_mask=_str(get, "robot.delta_mask"),
        norm_stats=_path(get, "robot.norm_stats"),
        norm_mode=_str(get, "robot.norm_mode"),
        asset_id=_str(get, "robot.asset_id"),
    )


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA device here")
    return device


def _int(get, name: str) -> int:
    value = get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"parameter {name}={value!r} must be an integer")
    return int(value)


def _max_len(get) -> int:
    """'auto' or 0 -> 0 (EngineConfig sizes the arena for the preset), else rows >= 1."""
    if get("arena.max_len") == "auto":
        return 0
    rows = _int(get, "arena.max_len")
    if rows < 0:
        raise ValueError(f"parameter arena.max_len={rows} must be auto, 0 (auto) or > 0")
    return rows


def _delay(get) -> int | str:
    """'measured', or ticks as an integer."""
    return "measured" if get("rtc.delay") == "measured" else _int(get, "rtc.delay")


def _float(get, name: str) -> float:
    value = get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"parameter {name}={value!r} must be a number")
    return float(value)


def _str(get, name: str) -> str:
    value = get(name)
    if not isinstance(value, str):
        raise ValueError(f"parameter {name}={value!r} must be a string")
    return value


def _path(get, name: str) -> str:
    """A folder parameter, `~` expanded; '' stays '' (none)."""
    value = _str(get, name)
    return str(Path(value).expanduser()) if value else ""


def _bool(get, name: str) -> bool:
    value = get(name)
    if not isinstance(value, bool):
        raise ValueError(f"parameter {name}={value!r} must be true or false")
    return value
