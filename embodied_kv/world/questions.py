"""Questions about the scene with one-word answers: colour, relative position, count.

Each kind draws its answer from a fixed candidate set, so chance accuracy is known
(`CHANCE`): the floor that random weights should sit near. `eval world` asks the KINDS;
training may also ask "where is the X ?" (-> left / middle / right, `ask_where`): it
teaches name -> position, the step before "left of" (issue 34)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.scene import Scene
from embodied_kv.world.vocab import COLOURS, number_word

KINDS = ("colour", "left", "count")
TRAIN_KINDS = (*KINDS, "where")  # kinds sample_question asks by name
CHANCE = {"colour": 1 / len(COLOURS), "left": 1 / 2, "count": 1 / 4, "where": 1 / 3}


@dataclass(frozen=True)
class QA:
    kind: str
    question: str
    answer: str
    # the things the question names, in the order it names them: (the words that name it,
    # table x, y); training regresses the position from the name's row (train/names.py)
    named: tuple[tuple[str, float, float], ...] = ()


def ask_colour(scene: Scene, rng: np.random.Generator) -> QA | None:
    """'what colour is the ball ?' for a shape that occurs once."""
    shapes = [t.shape for t in scene.things]
    unique = [t for t in scene.things if shapes.count(t.shape) == 1]
    if not unique:
        return None
    t = unique[rng.integers(len(unique))]
    return QA("colour", f"what colour is the {t.shape} ?", t.colour, ((t.shape, t.x, t.y),))


LEFT_MARGIN = 0.15  # table units: a pair closer in x than this is not asked about (4.8 px
# at 64 px; a person would not call one of two stacked objects "left of" the other either)


def ask_left(scene: Scene, rng: np.random.Generator) -> QA | None:
    """'is the red ball left of the blue box ?' -> yes / no, for a pair whose x differ
    by at least LEFT_MARGIN (None when no pair does)."""
    things = scene.things
    pairs = [(a, b) for a in range(len(things)) for b in range(len(things))
             if a != b and abs(things[a].x - things[b].x) >= LEFT_MARGIN]  # fmt: skip
    if not pairs:
        return None
    ta, tb = (things[i] for i in pairs[rng.integers(len(pairs))])
    return QA("left", f"is the {ta.name} left of the {tb.name} ?", "yes" if ta.x < tb.x else "no",
              ((ta.name, ta.x, ta.y), (tb.name, tb.x, tb.y)))  # fmt: skip


WHERE_EDGES = (-0.25, 0.25)  # x splitting the spawn range [-0.75, 0.75] into thirds
WHERE_MARGIN = 0.1  # a thing this close to an edge (3.2 px at 64 px) is not asked about
WHERE_WORDS = ("left", "middle", "right")


def where_word(x: float) -> str:
    """left / middle / right of table x (column: render.py's top camera)."""
    return WHERE_WORDS[int(x >= WHERE_EDGES[0]) + int(x >= WHERE_EDGES[1])]


def ask_where(scene: Scene, rng: np.random.Generator) -> QA | None:
    """'where is the red ball ?' -> left / middle / right, for a thing at least
    WHERE_MARGIN from both edges (None when none is)."""
    clear = [t for t in scene.things if min(abs(t.x - e) for e in WHERE_EDGES) >= WHERE_MARGIN]
    if not clear:
        return None
    t = clear[rng.integers(len(clear))]
    return QA("where", f"where is the {t.name} ?", where_word(t.x), ((t.name, t.x, t.y),))


def ask_count(scene: Scene, rng: np.random.Generator) -> QA:
    """'how many red objects are there ?' -> zero .. three."""
    colour = COLOURS[rng.integers(len(COLOURS))]
    n = sum(t.colour == colour for t in scene.things)
    return QA("count", f"how many {colour} objects are there ?", number_word(min(n, 3)))


def sample_question(scene: Scene, rng: np.random.Generator, kind: str | None = None) -> QA:
    """A question of `kind` (one of KINDS at random when None) about `scene`."""
    if kind is not None and kind not in TRAIN_KINDS:
        raise ValueError(f"unknown question kind {kind!r}; known {TRAIN_KINDS}")
    kind = kind or KINDS[rng.integers(len(KINDS))]
    if kind == "where":
        qa = ask_where(scene, rng)
        if qa is not None:
            return qa
        kind = "left"
    if kind == "colour":
        qa = ask_colour(scene, rng)
        if qa is not None:
            return qa
        kind = "left"
    if kind == "left":
        qa = ask_left(scene, rng)
        if qa is not None:
            return qa
    return ask_count(scene, rng)
