"""A seeded tabletop scene and its deterministic physics.

Table coordinates x (left -> right), y (near -> far) in [-1, 1]; the arm's height z in
[-1 (on the table), 1 (raised)]. The gripper attaches the nearest movable under it when
it closes low over it, and drops what it holds when it opens: into a container when the
release point is within the container's radius, else onto the table.

    state  [8]: x, y, z, gripper (-1 open, 1 closed), holding (0/1), 0, 0, 0
    action [8]: target x, y, z, gripper command (> 0 closes), 0, 0, 0, 0  (absolute)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from embodied_kv.world.vocab import COLOURS, CONTAINERS, MOVABLES

STATE_DIM = 8
ACTION_DIM = 8
REAL_ACTION_DIMS = 4  # x, y, z, gripper: the action dims the world reads; 4..7 are always 0
MAX_XY_STEP = 0.25  # table units the arm moves per action, per axis-norm
MAX_Z_STEP = 0.5
GRASP_RADIUS = 0.15  # xy distance within which a closing low gripper attaches a movable
LOW_Z = -0.8  # below this the gripper is low enough to grasp
CONTAINER_RADIUS = 0.22  # a movable released within this of a container's centre goes in
MOVABLE_SIZE = 0.13
CONTAINER_SIZE = 0.26
TABLE_EXTENT = 0.75  # objects spawn within [-extent, extent]
MIN_GAP = 0.45  # between spawned objects' centres


@dataclass
class Thing:
    colour: str
    shape: str
    x: float
    y: float
    inside: str | None = None  # the name of the container holding it

    @property
    def name(self) -> str:
        return f"{self.colour} {self.shape}"

    @property
    def is_container(self) -> bool:
        return self.shape in CONTAINERS


@dataclass
class Arm:
    x: float = 0.0
    y: float = -0.9
    z: float = 1.0
    closed: bool = False
    holding: str | None = None  # name of the attached movable


@dataclass
class Scene:
    things: list[Thing]
    arm: Arm = field(default_factory=Arm)

    def get(self, name: str) -> Thing:
        for t in self.things:
            if t.name == name:
                return t
        raise ValueError(f"no {name!r} in the scene; there are {[t.name for t in self.things]}")

    @property
    def movables(self) -> list[Thing]:
        return [t for t in self.things if not t.is_container]

    @property
    def containers(self) -> list[Thing]:
        return [t for t in self.things if t.is_container]

    def state(self) -> np.ndarray:
        """The robot state vector [STATE_DIM] in [-1, 1] (see the module docstring)."""
        a = self.arm
        s = np.zeros(STATE_DIM)
        s[:5] = (a.x, a.y, a.z, 1.0 if a.closed else -1.0, 1.0 if a.holding else 0.0)
        return s

    def copy(self) -> Scene:
        return copy.deepcopy(self)

    def step(self, action: np.ndarray) -> None:
        """Apply one action [>= 4] (absolute targets, speed-limited). Deterministic."""
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape[0] < 4 or not np.all(np.isfinite(action[:4])):
            raise ValueError(f"action needs 4 finite leading values, got {action[:4]}")
        a = self.arm
        target = np.clip(action[:3], -1.0, 1.0)
        d = target[:2] - (a.x, a.y)
        norm = float(np.hypot(*d))
        if norm > MAX_XY_STEP:
            d *= MAX_XY_STEP / norm
        a.x, a.y = a.x + float(d[0]), a.y + float(d[1])
        a.z += float(np.clip(target[2] - a.z, -MAX_Z_STEP, MAX_Z_STEP))
        close = bool(action[3] > 0)
        if close and not a.closed:
            self._grasp()
        elif not close and a.closed:
            self._release()
        a.closed = close
        if a.holding:
            held = self.get(a.holding)
            held.x, held.y = a.x, a.y

    def _grasp(self) -> None:
        a = self.arm
        if a.z > LOW_Z:
            return
        near = [
            (float(np.hypot(t.x - a.x, t.y - a.y)), i)
            for i, t in enumerate(self.things)
            if not t.is_container
        ]
        near = [(d, i) for d, i in near if d <= GRASP_RADIUS]
        if near:
            thing = self.things[min(near)[1]]
            thing.inside = None
            a.holding = thing.name

    def _release(self) -> None:
        a = self.arm
        if not a.holding:
            return
        held = self.get(a.holding)
        a.holding = None
        for c in self.containers:
            if np.hypot(c.x - held.x, c.y - held.y) <= CONTAINER_RADIUS:
                held.inside = c.name
                held.x, held.y = c.x, c.y
                return


def make_scene(rng: np.random.Generator, n_movables: int = 3, n_containers: int = 2) -> Scene:
    """Distinct (colour, shape) objects at well-separated places; some movables start in a
    container ("the key is in the red box")."""
    if not (1 <= n_movables <= len(COLOURS) * len(MOVABLES) and 1 <= n_containers <= 4):
        raise ValueError(f"bad object counts: movables={n_movables} containers={n_containers}")
    things: list[Thing] = []
    for kinds, n in ((CONTAINERS, n_containers), (MOVABLES, n_movables)):
        names: set[str] = set()
        while len(names) < n:
            names.add(f"{COLOURS[rng.integers(len(COLOURS))]} {kinds[rng.integers(len(kinds))]}")
        for name in sorted(names):
            colour, shape = name.split(" ")
            x, y = _free_spot(rng, things)
            things.append(Thing(colour, shape, x, y))
    scene = Scene(things)
    free = list(scene.containers)  # at most one movable per container, so a grasp is unambiguous
    for m in scene.movables:
        if free and rng.random() < 0.25:
            c = free.pop(int(rng.integers(len(free))))
            m.inside, m.x, m.y = c.name, c.x, c.y
    return scene


def _free_spot(rng: np.random.Generator, things: list[Thing]) -> tuple[float, float]:
    for _ in range(1000):
        x, y = rng.uniform(-TABLE_EXTENT, TABLE_EXTENT, size=2)
        if all(np.hypot(x - t.x, y - t.y) >= MIN_GAP for t in things):
            return float(x), float(y)
    raise RuntimeError("no free spot on the table: too many objects for MIN_GAP")
