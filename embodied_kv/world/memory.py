"""Memory facts that change over time, and planning queries across them.

A stream of facts about containers (where they are, open or closed) and movables (which
container holds them); later facts supersede earlier ones. Queries:

    one hop : 'where is the red box ?'  -> the place in the latest fact about the red box
    two hops: 'where is the blue key ?' -> the key's latest container -> its latest place
Facts that a container opened or closed change nothing a query asks: distractors.

A two-hop answer is the place ('shelf'), or in the `path` form the way to it, container
first ('in the red box on the shelf'): then each answer word needs one lookup, the place's
keyed by the container words just written (`embodied-kv recall-probe --data chain-cot`:
two lookups in one forward pass were not learned where this form was, docs/keep_research.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embodied_kv.world.vocab import COLOURS, CONTAINERS, MOVABLES, PLACES

CHANCE = {"one_hop": 1 / len(PLACES), "two_hop": 1 / len(PLACES)}  # place answers
ANSWER_FORMS = ("place", "path")  # how a two-hop answer is written (module doc)


@dataclass(frozen=True)
class MemoryQuery:
    hops: int
    facts: tuple[str, ...]  # in the order they arrived
    query: str
    answer: str  # the place
    container: str = ""  # two hops: the movable's latest container

    def target(self, form: str = "place") -> str:
        """The answer text a model is trained to write: `form` 'place' or 'path'."""
        if form not in ANSWER_FORMS:
            raise ValueError(f"answer form {form!r}: use one of {ANSWER_FORMS}")
        if form == "path" and self.hops == 2:
            return f"in the {self.container} on the {self.answer}"
        return self.answer

    @property
    def prompt(self) -> str:
        """The plan request's text, appended after a frame's prefix (TaskKind.PLAN)."""
        return f"\nFacts: {' '.join(self.facts)}{self.follow_up}"

    @property
    def follow_up(self) -> str:
        """The query alone: what a further query over the same facts appends (training)."""
        return f"\nQuery: {self.query}\nAnswer: "


def fact_stream(rng: np.random.Generator, n_containers: int, n_movables: int, n_updates: int):
    """-> (facts in arrival order, final places {container: place}, final holder
    {movable: container}). Every container gets a place fact first, every movable a
    container fact; then `n_updates` random moves (containers change place, movables
    change container, containers open or close)."""
    containers = _names(rng, CONTAINERS, n_containers)
    movables = _names(rng, MOVABLES, n_movables)
    place = {c: PLACES[rng.integers(len(PLACES))] for c in containers}
    holder = {m: containers[rng.integers(len(containers))] for m in movables}
    facts = [f"the {c} is on the {place[c]} ." for c in containers]
    facts += [f"the {m} is in the {holder[m]} ." for m in movables]
    order = rng.permutation(len(facts))
    facts = [facts[i] for i in order]
    for _ in range(n_updates):
        r = rng.random()
        if r < 0.5:
            c = containers[rng.integers(len(containers))]
            place[c] = PLACES[rng.integers(len(PLACES))]
            facts.append(f"the {c} is on the {place[c]} .")
        elif r < 0.8:
            m = movables[rng.integers(len(movables))]
            holder[m] = containers[rng.integers(len(containers))]
            facts.append(f"the {m} is in the {holder[m]} .")
        else:
            c = containers[rng.integers(len(containers))]
            facts.append(f"the {c} is {'open' if rng.random() < 0.5 else 'closed'} .")
    return facts, place, holder


def sample_query(
    rng: np.random.Generator,
    hops: int,
    n_containers: int = 2,
    n_movables: int = 2,
    n_updates: int = 1,
) -> MemoryQuery:
    """A fact stream and a query needing `hops` (1 or 2) lookups into it."""
    return sample_queries(rng, [hops], n_containers, n_movables, n_updates)[0]


def sample_queries(
    rng: np.random.Generator,
    hops: list[int],
    n_containers: int = 2,
    n_movables: int = 2,
    n_updates: int = 1,
    hard: float = 0.0,
) -> list[MemoryQuery]:
    """One fact stream and a query per entry of `hops` over it (training asks several
    about the same facts: more answers per prefill). A share `hard` of the queries asks
    about a subject whose answer is not the last place the facts name, where copying that
    place (the recency shortcut) is wrong (0: no draws for it, the stream as before)."""
    if not hops or any(h not in (1, 2) for h in hops):
        raise ValueError(f"hops={hops}; only 1 and 2 are defined")
    facts, place, holder = fact_stream(rng, n_containers, n_movables, n_updates)
    last = [f.split()[-2] for f in facts if " is on the " in f][-1]
    out = []
    answers = {1: place, 2: {m: place[c] for m, c in holder.items()}}  # subject -> place
    for h in hops:
        pool = sorted(answers[h])
        if hard > 0 and rng.random() < hard:
            pool = [s for s in pool if answers[h][s] != last] or pool
        s = pool[rng.integers(len(pool))]
        box = holder[s] if h == 2 else ""
        out.append(MemoryQuery(h, tuple(facts), f"where is the {s} ?", answers[h][s], box))
    return out


def names_place(got: str, place: str) -> bool:
    """A model's answer text names `place` as the answer: the place alone, or a path
    that ends there ('in the red box on the shelf')."""
    return got == place or (got.startswith("in the ") and got.endswith(f" on the {place}"))


def _names(rng: np.random.Generator, shapes: tuple[str, ...], n: int) -> list[str]:
    if n > len(shapes) * len(COLOURS):
        raise ValueError(f"{n} distinct objects of {shapes} do not exist")
    names: set[str] = set()
    while len(names) < n:
        names.add(f"{COLOURS[rng.integers(len(COLOURS))]} {shapes[rng.integers(len(shapes))]}")
    return sorted(names)
