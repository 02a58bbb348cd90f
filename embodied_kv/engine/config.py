"""The engine's configuration: one frozen dataclass the ROS parameters
(engine/params.py), the demo and the benchmarks build, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied_kv.engine.plan_memory import MODES
from embodied_kv.kv.capsule_store import StoreConfig
from embodied_kv.kv.compress import CompressConfig
from embodied_kv.kv.memory import MemoryConfig
from embodied_kv.kv.selectors import KeepConfig
from embodied_kv.model.action_tokens import ActionTokenConfig
from embodied_kv.model.robot_loader import RobotSpec
from embodied_kv.model.rtc import RTCConfig


@dataclass(frozen=True)
class EngineConfig:
    preset: str = "tiny"
    device: str = "cpu"
    weights: str = ""  # safetensors, LeRobot or openpi dir; "" = the preset's shipped, else random
    tokenizer: str = ""  # pi05: PaliGemma tokenizer path; "" = the checkpoint dir's, if any
    num_slots: int = 8  # arena slots: the frame in flight + live language requests
    max_len: int = 0  # arena rows per slot; 0 = auto: what the preset needs (policy.arena_rows)
    control_hz: float = 50.0  # action output rate
    replan_every: int = 5  # actions per control cycle: a new chunk every this many ticks
    blend: int = 2  # ticks over which an old and a new chunk are mixed
    threads: int = 1  # torch CPU threads (bench/report.py: why one)
    narrate_every: int = 0  # every Nth frame narrates (0: never)
    narration_tokens: int = 32
    answer_tokens: int = 48
    max_decode_steps: int = 0  # per cycle; 0 = as many as fit before the deadline
    max_pending: int = 16  # questions + plan requests waiting for a slot; more are refused
    request_tokens: int = 0  # longest question / plan prompt (tokens); 0 = the preset's prompt
    seed: int = 0  # action noise of frame t: seed + t
    history: int = 8  # automatic per-cycle boundaries kept for rollback by steps (0: off)
    max_cycle_failures: int = 3  # failed cycles in a row before the safe state
    auto_episode_capsule: bool = True  # snapshot `episode_start` when an episode begins
    cuda_graphs: bool = True  # capture decode / prefill / denoise graphs on CUDA
    store: StoreConfig = field(default_factory=StoreConfig)
    robot: RobotSpec = field(default_factory=RobotSpec)  # dims, statistics, delta mask
    action_mode: str = "flow"  # flow: the action expert | ar: action tokens (ActionFlow)
    ar: ActionTokenConfig = field(default_factory=ActionTokenConfig)  # the `ar` tokens
    ar_unified: bool = True  # ar: language decodes join the pipeline's packed step
    compress: CompressConfig = field(default_factory=CompressConfig)  # VL-Cache (language.kv_*)
    # plans read the memory as text (full recomputation, exact) | "keep": as cached KV
    # (KEEP; lossy, opt-in: on the world model it lost 13-21 two-hop points through the
    # engine at 5-40 facts, `bench plan_memory`, docs/keep.md)
    memory_mode: str = "full"
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # KEEP window t, grouping
    keep: KeepConfig = field(default_factory=KeepConfig)  # KEEP recompute ratios r_i, hops
    # KEEP from this many memory segments on; a smaller memory's plans are prefilled whole
    # (exact): at 5 facts KEEP lost 14 two-hop points for no time worth saving (docs/keep.md)
    keep_min_segments: int = 16
    keep_graphs: bool = False  # KEEP's prefill from CUDA graphs where the engine has graphs
    rtc: RTCConfig = field(default_factory=RTCConfig)  # real-time chunking (flow; docs/rtc.md)

    def __post_init__(self):
        if self.control_hz <= 0 or self.replan_every < 1 or self.history < 0 or self.max_len < 0:
            raise ValueError(f"bad engine config: {self}")
        if self.action_mode not in ("flow", "ar"):
            raise ValueError(f"action_mode={self.action_mode!r}: use 'flow' or 'ar'")
        if self.action_mode == "ar" and self.rtc.enabled:
            raise ValueError("rtc.enabled works with action_mode 'flow' only (it guides the "
                             "action expert's Euler loop)")  # fmt: skip
        if self.keep_min_segments < 0:
            raise ValueError(f"keep_min_segments={self.keep_min_segments} must be >= 0")
        if self.memory_mode not in MODES:
            raise ValueError(f"memory_mode={self.memory_mode!r}: use one of {MODES}")
        if self.action_mode == "ar" and self.compress.enabled:  # refused, not ignored
            raise ValueError(f"language.kv_budget={self.compress.budget} (VL-Cache) works with "
                             "action_mode 'flow' only: 'ar' prefills inside ActionFlow's packed "
                             "step, which records no statistics; set kv_budget: 1.0")  # fmt: skip
        if self.max_pending < 1 or self.max_cycle_failures < 1:
            raise ValueError(
                f"max_pending={self.max_pending} and max_cycle_failures="
                f"{self.max_cycle_failures} must be >= 1"
            )

    @property
    def period_s(self) -> float:
        return self.replan_every / self.control_hz
