"""The engine facade: one model, one KV manager, one action queue, one capsule store.

This is what the ROS nodes, the demo and the benchmarks drive. Every verb takes the
engine lock, so a service call never interleaves with a control cycle; the action
queue has its own lock and is popped by the output path without waiting for it.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field

import torch

from embodied_kv.engine.action_queue import ActionQueue
from embodied_kv.engine.ar_loop import ARLoop
from embodied_kv.engine.frame_loop import CycleResult, FrameLoop
from embodied_kv.engine.graphs import GraphRunner, default_mode
from embodied_kv.engine.policy import LoopConfig, arena_rows_needed
from embodied_kv.kv.capsule import (
    Identity,
    capture,
    check_identity,
    identity_of,
    load_slot,
    restore,
)
from embodied_kv.kv.capsule_store import CapsuleInfo, CapsuleStore, StoreConfig
from embodied_kv.kv.manager import KVCacheManager, TaskKind
from embodied_kv.model.action_space import RobotIO
from embodied_kv.model.action_tokens import (
    ActionTokenConfig,
    action_model_config,
    make_action_tokenizer,
)
from embodied_kv.model.config import ModelConfig, get_preset
from embodied_kv.model.robot_loader import RobotSpec, find_tokenizer, load_robot_io
from embodied_kv.model.vla import Observation, build_model
from embodied_kv.timing import device_clock, elapsed_ms

EPISODE_START = "episode_start"


@dataclass(frozen=True)
class EngineConfig:
    preset: str = "tiny"
    device: str = "cpu"
    weights: str = ""  # safetensors file, LeRobot policy dir or openpi dir; "" = random
    tokenizer: str = ""  # pi05: PaliGemma tokenizer path; "" = the checkpoint dir's, if any
    num_slots: int = 8  # arena slots: the frame in flight + live language requests
    max_len: int = 0  # arena rows per slot; 0 = auto: what the preset needs (arena_rows_needed)
    control_hz: float = 50.0  # action output rate
    replan_every: int = 5  # actions per control cycle: a new chunk every this many ticks
    blend: int = 2  # ticks over which an old and a new chunk are mixed
    threads: int = 1  # torch CPU threads (bench/report.py: why one)
    narrate_every: int = 0  # every Nth frame narrates (0: never)
    narration_tokens: int = 32
    answer_tokens: int = 48
    max_decode_steps: int = 0  # per cycle; 0 = as many as fit before the deadline
    seed: int = 0  # action noise of frame t: seed + t
    history: int = 8  # automatic per-cycle boundaries kept for rollback by steps (0: off)
    auto_episode_capsule: bool = True  # snapshot `episode_start` when an episode begins
    cuda_graphs: bool = True  # capture decode / prefill / denoise graphs on CUDA
    store: StoreConfig = field(default_factory=StoreConfig)
    robot: RobotSpec = field(default_factory=RobotSpec)  # dims, statistics, delta mask
    action_mode: str = "flow"  # flow: the action expert | ar: action tokens (ActionFlow)
    ar: ActionTokenConfig = field(default_factory=ActionTokenConfig)  # the `ar` tokens
    ar_unified: bool = True  # ar: language decodes join the pipeline's packed step

    def __post_init__(self):
        if self.control_hz <= 0 or self.replan_every < 1 or self.history < 0 or self.max_len < 0:
            raise ValueError(f"bad engine config: {self}")
        if self.action_mode not in ("flow", "ar"):
            raise ValueError(f"action_mode={self.action_mode!r}: use 'flow' or 'ar'")

    @property
    def period_s(self) -> float:
        return self.replan_every / self.control_hz


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        model=None,
        robot: RobotIO | None = None,
        graph_mode: str | None = None,
    ):
        """graph_mode: engine/graphs.py's "cuda", "emulate" or "off"; None = CUDA graphs
        on a CUDA device when cfg.cuda_graphs, else none."""
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        c = model.cfg if model is not None else get_preset(cfg.preset)
        # The robot's units at the engine boundary: observe() normalises the state, every
        # chunk is un-normalised and sliced before the queue (model/action_space.py).
        self.robot = robot or load_robot_io(cfg.robot, cfg.weights, c.state_dim, c.action_dim)
        self.lock = threading.RLock()
        loop_cfg = LoopConfig(
            period_s=cfg.period_s,
            narrate_every=cfg.narrate_every,
            narration_tokens=cfg.narration_tokens,
            answer_tokens=cfg.answer_tokens,
            max_decode_steps=cfg.max_decode_steps,
            seed=cfg.seed,
        )
        rows = arena_rows(cfg, c, loop_cfg)  # a bad max_len fails before any weight is built
        self.model = model or load_model(cfg)
        self.manager = KVCacheManager(self.model, cfg.num_slots, rows)
        self.action_tokens = None
        if cfg.action_mode == "ar":  # the model's vocabulary holds the action ids
            tok = make_action_tokenizer(cfg.ar, self.model.cfg, self.model.tokenizer)
            self.action_tokens = tok
            self.queue = ActionQueue(tok.horizon, self.robot.action_dim, cfg.blend)
            self.loop = ARLoop(
                self.manager, self.queue, loop_cfg, tok, cfg.ar_unified, robot=self.robot
            )
        else:
            self.queue = ActionQueue(c.action_horizon, self.robot.action_dim, cfg.blend)
            self.loop = FrameLoop(self.manager, self.queue, loop_cfg, robot=self.robot)
        self.store = CapsuleStore(cfg.store, self.model.device)
        if graph_mode is None:
            graph_mode = default_mode(self.model.device) if cfg.cuda_graphs else "off"
        self.graphs = None
        if graph_mode != "off":
            self.graphs = GraphRunner(self.model, self.manager.arena, mode=graph_mode)
            self.model.graphs = self.graphs
        base = identity_of(self.model, self.manager.arena)
        # The action queue a capsule holds is in robot units: other statistics, dims or
        # delta mask make it another config.
        robot = hashlib.sha256((base.config + self.robot.fingerprint()).encode()).hexdigest()
        self.identity = Identity(base.weights, robot)
        self.frame = 0
        self.instruction = ""
        self.history: list[str] = []
        self._obs: Observation | None = None

    # -- inputs ----------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        """obs.state in robot units ([robot.state_dim]); ValueError if it does not fit."""
        model_obs = self.robot.model_observation(obs)
        with self.lock:
            self._obs = model_obs
            self.instruction = obs.instruction

    def ask(self, request_id: str, text: str, kind: TaskKind = TaskKind.ANSWER) -> None:
        self.loop.policy.ask(request_id, text, kind)

    # -- the control cycle -------------------------------------------------------------

    def cycle(self, tick: int) -> CycleResult | None:
        """One control cycle on the latest observation; None before the first one."""
        with self.lock:
            if self._obs is None:
                return None
            result = self.loop.cycle(self._obs, self.frame, tick)
            self.frame += 1
            if self.cfg.history:
                self._record_boundary()
            return result

    def warmup(self) -> None:
        """Capture the CUDA graphs (on CUDA) and run one cycle's work without a deadline."""
        with self.lock:
            if self.graphs is not None:
                self.graphs.capture()
            if self._obs is not None:
                self.loop.warmup(self._obs)

    # -- episodes and capsules ---------------------------------------------------------

    def begin_episode(self) -> None:
        """Empty every slot, request and queue; frame 0; snapshot `episode_start`."""
        with self.lock:
            for req in list(self.manager.requests.values()):
                self.manager.release(req)
            for s in self.manager.arena.in_use():
                self.manager.arena.release(s)
            if isinstance(self.loop, ARLoop):
                self.loop.flow.reserve()  # the ring's slots stay the pipeline's
            self.manager.counters = type(self.manager.counters)()
            self.queue.load_state(
                {"last": torch.zeros(self.queue.action_dim, dtype=torch.float64)},
                {"start": 0, "counters": {}},
            )
            self.frame = 0
            for name in self.history:
                if name in self.store:
                    self.store.delete(name)
            self.history.clear()
            if self.cfg.auto_episode_capsule:
                self.snapshot(EPISODE_START, "gpu", pin=True)

    def sections(self) -> dict:
        if isinstance(self.loop, ARLoop):  # the frames in flight are state
            return {"queue": self.queue, "engine": self, "pipeline": self.loop.flow}
        return {"queue": self.queue, "engine": self}

    def snapshot(
        self, name: str, tier: str = "gpu", pin: bool = False
    ) -> tuple[CapsuleInfo, float]:
        """Capture the whole boundary -> (info, elapsed ms)."""
        with self.lock:
            clock = device_clock(self.model.device)
            t = clock()
            cap = capture(
                name,
                self.manager.arena,
                self.manager,
                self.identity,
                self.sections(),
                {"instruction": self.instruction, "frame": self.frame},
            )
            info = self.store.put(cap, tier, pin)
            return info, elapsed_ms(t, clock)

    def restore(self, name: str = EPISODE_START, kv_only: bool = False) -> float:
        """Restore a capsule into the live state -> elapsed ms."""
        with self.lock:
            clock = device_clock(self.model.device)
            t = clock()
            cap = self.store.get(name)
            restore(cap, self.manager.arena, self.manager, self.identity, self.sections(), kv_only)
            return elapsed_ms(t, clock)

    def rollback(self, name: str = "", steps_back: int = 0) -> float:
        """Restore a named capsule, or the boundary `steps_back` cycles before the last."""
        with self.lock:
            if name:
                return self.restore(name)
            if not 0 <= steps_back < len(self.history):
                raise ValueError(
                    f"steps_back={steps_back}: {len(self.history)} boundaries kept (history)"
                )
            ms = self.restore(self.history[-1 - steps_back])
            for stale in self.history[len(self.history) - steps_back :]:
                if stale in self.store:
                    self.store.delete(stale)
            del self.history[len(self.history) - steps_back :]
            return ms

    def fork(self, name: str, n: int) -> list[list[int]]:
        """n independent copies of a capsule's slots in free slots -> slot ids per branch."""
        with self.lock:
            cap = self.store.get(name)
            check_identity(cap, self.identity)
            arena = self.manager.arena
            slots = cap.meta["arena"]["slots"]
            if n < 1 or n * len(slots) > arena.num_free:
                raise ValueError(
                    f"fork of {name!r} x{n} needs {n * len(slots)} free slots, "
                    f"{arena.num_free} are free"
                )
            branches = []
            for _ in range(n):
                branch = []
                for s in slots:
                    d = arena.allocate()
                    load_slot(cap, arena, s, d)
                    branch.append(d)
                branches.append(branch)
            return branches

    def _record_boundary(self) -> None:
        name = f"auto-{self.frame}"
        self.snapshot(name, "gpu")
        if name in self.history:  # after a rollback the frame numbers come round again
            self.history.remove(name)
        self.history.append(name)
        while len(self.history) > self.cfg.history:
            old = self.history.pop(0)
            if old in self.store:
                self.store.delete(old)

    # -- capsule section of the engine itself --------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def state_meta(self) -> dict:
        return {
            "frame": self.frame,
            "instruction": self.instruction,
            "loop": vars(self.loop.counters).copy(),
        }

    def load_state(self, tensors: dict, meta: dict) -> None:
        self.frame = int(meta["frame"])
        self.instruction = meta["instruction"]
        self.loop.counters = type(self.loop.counters)(**meta["loop"])


def arena_rows(cfg: EngineConfig, model: ModelConfig, loop: LoopConfig) -> int:
    """cfg.max_len, or what the preset and the language budgets need when it is 0."""
    needed = arena_rows_needed(model, loop)
    if cfg.max_len == 0:
        return needed
    if cfg.max_len < needed:
        raise ValueError(
            f"max_len={cfg.max_len} is too small for preset {model.name!r}: a frame needs "
            f"{needed} rows per slot ({model.num_cameras} cameras x {model.vision.tokens} "
            f"image tokens + {model.max_text_tokens} prompt + {model.max_text_tokens} question "
            f"+ {max(loop.narration_tokens, loop.answer_tokens)} decoded, rounded up); "
            f"set max_len to {needed} or more, or 0 (auto)"
        )
    return cfg.max_len


def load_model(cfg: EngineConfig):
    tokenizer = cfg.tokenizer or find_tokenizer(cfg.weights)
    model_cfg = get_preset(cfg.preset)
    if cfg.action_mode == "ar":  # room for the action ids (tiny grows, pi05 has it)
        model_cfg = action_model_config(model_cfg, cfg.ar.n_action_ids())
    model = build_model(model_cfg, cfg.device, tokenizer_path=tokenizer)
    if cfg.weights:
        load_weights_file(model, cfg.weights)
    return model


def load_weights_file(model, path: str) -> None:
    """The package's own layout when the file says so, else the public pi0.5 layout."""
    from pathlib import Path

    from safetensors import safe_open

    from embodied_kv.model.checkpoint import load_pi05_checkpoint
    from embodied_kv.model.weights import FORMAT, load_weights

    p = Path(path)
    if p.is_file():
        with safe_open(str(p), framework="pt") as f:
            if (f.metadata() or {}).get("format") == FORMAT:
                load_weights(model, p)
                return
    load_pi05_checkpoint(model, p)
