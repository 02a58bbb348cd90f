"""Questions about the scene with one-word answers: colour, relative position, count.

Each kind draws its answer from a fixed candidate set, so chance accuracy is known
(`CHANCE`): the floor that random weights should sit near."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.scene import Scene
from embodied_kv.world.vocab import COLOURS, number_word

KINDS = ("colour", "left", "count")
CHANCE = {"colour": 1 / len(COLOURS), "left": 1 / 2, "count": 1 / 4}  # counts 0..3


@dataclass(frozen=True)
class QA:
    kind: str
    question: str
    answer: str


def ask_colour(scene: Scene, rng: np.random.Generator) -> QA | None:
    """'what colour is the ball ?' for a shape that occurs once."""
    shapes = [t.shape for t in scene.things]
    unique = [t for t in scene.things if shapes.count(t.shape) == 1]
    if not unique:
        return None
    t = unique[rng.integers(len(unique))]
    return QA("colour", f"what colour is the {t.shape} ?", t.colour)


def ask_left(scene: Scene, rng: np.random.Generator) -> QA:
    """'is the red ball left of the blue box ?' -> yes / no (objects never share an x)."""
    a, b = rng.choice(len(scene.things), size=2, replace=False)
    ta, tb = scene.things[a], scene.things[b]
    return QA("left", f"is the {ta.name} left of the {tb.name} ?", "yes" if ta.x < tb.x else "no")


def ask_count(scene: Scene, rng: np.random.Generator) -> QA:
    """'how many red objects are there ?' -> zero .. three."""
    colour = COLOURS[rng.integers(len(COLOURS))]
    n = sum(t.colour == colour for t in scene.things)
    return QA("count", f"how many {colour} objects are there ?", number_word(min(n, 3)))


def sample_question(scene: Scene, rng: np.random.Generator, kind: str | None = None) -> QA:
    """A question of `kind` (random when None) about `scene`."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}; known {KINDS}")
    kind = kind or KINDS[rng.integers(len(KINDS))]
    if kind == "colour":
        qa = ask_colour(scene, rng)
        if qa is not None:
            return qa
        kind = "left"
    return ask_left(scene, rng) if kind == "left" else ask_count(scene, rng)
