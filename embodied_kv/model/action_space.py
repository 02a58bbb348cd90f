"""The robot's side of the model: its state in, its joint commands out.

The model reads a state normalised to about [-1, 1] (discretised into the prompt) and
writes `action_dim` (32 at pi05) padded dimensions in normalised units. A robot has
`state_dim` state values and `action_dim` commands of its own, in its own units;
some checkpoints predict some dimensions as deltas to the current state.

    robot state [S] --normalize--> model state [S]            (prompt: S bins, no padding)
    model chunk [H, A_model] --[:, :A]--> --unnormalize--> [H, A] --(+ state where mask)--> robot

The order is the references': openpi `Normalize` ... `Unnormalize`, `AbsoluteActions`
(policy_config.create_trained_policy) and LeRobot `unnormalize` then
`AbsoluteActionsProcessorStep` (processor_pi05.py): the delta is added in robot units,
to the state as the robot reported it.

The engine applies this at its boundary (Engine.observe: state in; every scheduler's
chunk: actions out), so the action queue, `action` and `action_chunk` carry robot units.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from embodied_kv.model.normalize import IDENTITY, FeatureNorm, NormMode


def make_bool_mask(*dims: int) -> tuple[bool, ...]:
    """openpi `transforms.make_bool_mask`: (6, -1) -> six True then one False."""
    out: list[bool] = []
    for d in dims:
        out += [d > 0] * abs(d)
    return tuple(out)


def parse_mask(text: str) -> tuple[bool, ...] | None:
    """YAML `robot.delta_mask`: "" -> None (the checkpoint decides), "none" -> (), or the
    arguments of openpi's make_bool_mask, e.g. "6,-1" (six delta joints, absolute gripper)."""
    text = text.strip()
    if not text:
        return None
    if text.lower() == "none":
        return ()
    try:
        dims = [int(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(
            f"delta_mask {text!r}: give make_bool_mask counts like '6,-1' (6 delta dims, then "
            "1 absolute), 'none' or ''"
        ) from None
    if any(d == 0 for d in dims):
        raise ValueError(f"delta_mask {text!r}: a count of 0 means nothing")
    return make_bool_mask(*dims)


@dataclass(frozen=True, eq=False)
class RobotIO:
    state_dim: int  # robot state values (joint_states in joint_names order)
    action_dim: int  # robot commands published per tick (one per joint name)
    state: FeatureNorm = IDENTITY  # robot state -> model state
    action: FeatureNorm = IDENTITY  # model actions -> robot actions (inverse)
    delta_mask: tuple[bool, ...] = ()  # True: that action dim is a delta to the state
    source: str = "identity: no statistics"  # said at configure and in the demo output

    def __post_init__(self):
        if min(self.state_dim, self.action_dim) < 1:
            raise ValueError(f"state_dim={self.state_dim}, action_dim={self.action_dim}: >= 1")
        for what, norm, n in (("state", self.state, self.state_dim),
                              ("action", self.action, self.action_dim)):  # fmt: skip
            if norm.dim is not None and norm.dim != n:
                raise ValueError(
                    f"{norm.source}: {what} statistics have {norm.dim} dims, the robot's "
                    f"{what}_dim is {n}"
                )
        if len(self.delta_mask) > self.action_dim:
            raise ValueError(
                f"delta_mask has {len(self.delta_mask)} entries > action_dim {self.action_dim}"
            )
        if any(self.delta_mask) and len(self.delta_mask) > self.state_dim:
            raise ValueError(
                f"delta actions add the state: delta_mask of {len(self.delta_mask)} dims > "
                f"state_dim {self.state_dim}"
            )

    @property
    def identity(self) -> bool:
        plain = (self.state.mode, self.action.mode) == (NormMode.IDENTITY, NormMode.IDENTITY)
        return plain and not any(self.delta_mask)

    def describe(self) -> str:
        deltas = sum(self.delta_mask)
        return (
            f"state {self.state_dim} dims in, {self.action_dim} action dims out"
            f"{f' ({deltas} as deltas to the state)' if deltas else ''}; "
            f"normalisation {self.source}"
        )

    def fingerprint(self) -> str:
        """sha256 of everything that decides the robot units (dims, modes, statistics, mask)."""
        h = hashlib.sha256(repr((self.state_dim, self.action_dim, self.delta_mask)).encode())
        for norm in (self.state, self.action):
            h.update(repr((norm.mode.value, norm.convention, norm.eps)).encode())
            for key in sorted(norm.stats):
                h.update(key.encode() + np.ascontiguousarray(norm.stats[key]).tobytes())
        return h.hexdigest()

    def check_model(self, model_state_dim: int, model_action_dim: int) -> None:
        if self.state_dim > model_state_dim or self.action_dim > model_action_dim:
            raise ValueError(
                f"robot state_dim {self.state_dim} / action_dim {self.action_dim} exceed the "
                f"model's {model_state_dim} / {model_action_dim}"
            )

    def state_in(self, state: np.ndarray) -> np.ndarray:
        """Robot state [state_dim] -> model state [state_dim] (normalised, not padded)."""
        state = np.asarray(state, dtype=np.float64).reshape(-1)
        if state.shape[0] != self.state_dim:
            raise ValueError(f"state has {state.shape[0]} values, the robot's has {self.state_dim}")
        return self.state.normalize(state).astype(np.float64)

    def actions_out(self, chunk: np.ndarray, state: np.ndarray | None) -> np.ndarray:
        """Model chunk [H, A_model] -> robot chunk [H, action_dim] float64.

        state: the robot state [state_dim] of the observation the chunk was computed
        from (robot units); needed only when some dimension is a delta."""
        x = self.action.unnormalize(np.asarray(chunk)[..., : self.action_dim])
        x = np.asarray(x, dtype=np.float64).copy()
        if any(self.delta_mask):
            if state is None:
                raise ValueError("delta actions need the robot state of the observation")
            n = len(self.delta_mask)
            offset = np.where(self.delta_mask, np.asarray(state, dtype=np.float64)[:n], 0.0)
            x[..., :n] += offset  # openpi AbsoluteActions; LeRobot to_absolute_actions
        return x

    def model_observation(self, obs):
        """An Observation in robot units -> the same with the model's state; the robot
        state is kept in `robot_state` for delta actions."""
        raw = np.asarray(obs.state, dtype=np.float64).reshape(-1)
        return dataclasses.replace(obs, state=self.state_in(raw), robot_state=raw)


def identity_io(state_dim: int, action_dim: int) -> RobotIO:
    return RobotIO(state_dim, action_dim)
