"""States the policy itself visits (DAgger, issue 34), kept as a file of replays.

A closed loop drifts into states the expert's rollouts never show (covariate shift);
DAgger trains on those states with the expert's labels. A visited state is stored as
what makes it, not as pixels: the world episode's seed and the actions the policy
executed from its start. `replay` rebuilds the scene with the world's own deterministic
physics; the expert labels it when a training sample is drawn (world/dataset.py
`visited_share`). eval/visited.py collects the file with a trained model.

    {"format": "embodied_kv.visited", "version": 1,
     "states": [{"seed": int, "actions": [[x, y, z, gripper], ...]}, ...]}

Written atomically; loading checks every field (seeds in range, actions finite and of
the world's 4 real dims, bounded counts) and runs nothing but `Scene.step`.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodied_kv.world.scene import REAL_ACTION_DIMS, Scene
from embodied_kv.world.tasks import PutTask, episode

FORMAT, VERSION = "embodied_kv.visited", 1
MAX_STATES = 1_000_000
MAX_ACTIONS = 1_000  # per state: an episode's executed actions
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class VisitedState:
    seed: int  # the world episode (tasks.episode)
    actions: np.ndarray  # [n, REAL_ACTION_DIMS] float64 executed from the episode's start

    def replay(self) -> tuple[Scene, PutTask]:
        scene, task = episode(self.seed)
        for a in self.actions:
            scene.step(a)
        return scene, task


def save_visited(states: list[VisitedState], path: str | Path) -> Path:
    """Write the states to `path` atomically (a temp file renamed into place)."""
    path = Path(path)
    doc = {"format": FORMAT, "version": VERSION,
           "states": [{"seed": int(s.seed), "actions": np.asarray(s.actions).tolist()}
                      for s in states]}  # fmt: skip
    check_states(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600: the file is data to share, as the weights
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_visited(path: str | Path) -> tuple[VisitedState, ...]:
    """The verified states of `path` (ValueError naming what is wrong); cached per file
    version, so the data workers read it once."""
    p = Path(path)
    try:
        stat = p.stat()
    except OSError as e:
        raise ValueError(f"visited states {path}: {e}") from e
    return _load(str(p.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _load(path: str, _mtime: int, _size: int) -> tuple[VisitedState, ...]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"visited states {path}: not readable JSON ({e})") from e
    return check_states(doc, path)


def check_states(doc, where: str = "visited states") -> tuple[VisitedState, ...]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file")
    if doc.get("version") != VERSION:
        raise ValueError(f"{where}: version {doc.get('version')!r}, this code reads {VERSION}")
    states = doc.get("states")
    if not isinstance(states, list) or not 0 < len(states) <= MAX_STATES:
        raise ValueError(f"{where}: 'states' must be a list of 1..{MAX_STATES} states")
    out = []
    for i, s in enumerate(states):
        if not isinstance(s, dict) or set(s) != {"seed", "actions"}:
            raise ValueError(f"{where}: state {i} must hold exactly 'seed' and 'actions'")
        seed, acts = s["seed"], s["actions"]
        if type(seed) is not int or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"{where}: state {i}: seed {seed!r} is not an int in [0, 2^63)")
        try:
            a = np.asarray(acts, dtype=np.float64).reshape(-1, REAL_ACTION_DIMS)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: state {i}: actions are not numbers [n, "
                             f"{REAL_ACTION_DIMS}] ({e})") from e  # fmt: skip
        if not isinstance(acts, list) or len(acts) != a.shape[0] or a.shape[0] > MAX_ACTIONS:
            raise ValueError(f"{where}: state {i}: actions must be a list of at most "
                             f"{MAX_ACTIONS} rows of {REAL_ACTION_DIMS}")  # fmt: skip
        if not np.isfinite(a).all():
            raise ValueError(f"{where}: state {i}: actions must be finite")
        out.append(VisitedState(seed, a))
    return tuple(out)
