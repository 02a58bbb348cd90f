"""World memory streams for `bench keep`: N fact segments (world/memory.py), updates
between plan requests, and the true answers of the memory as the prompt lists it.

A segment is one fact sentence, id `fact/<i>` in arrival order, grouped by its
subject (`red box`: its place and open/closed facts; `blue key`: its container), so
every fact about one subject stays in one group, in arrival order, and "a later fact
supersedes an earlier one" holds in the prompt whatever order the groups take. An
update rewrites the latest fact of one (subject, kind) in place: a container moves,
a movable changes container, a container opens or closes (a distractor). Updates hit
a few hot subjects most of the time, so the others' groups turn static (KEEP's t).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from embodied_kv.world.memory import fact_stream
from embodied_kv.world.vocab import PLACES

HOT_SHARE = 0.8  # share of updates that hit the hot subjects
HOT_SUBJECTS = 2


def parse(fact: str) -> tuple[str, str, str]:
    """'the red box is on the shelf .' -> ('red box', 'place', 'shelf'); 'in the C' ->
    ('M', 'holder', 'C'); 'is open .' -> ('C', 'state', 'open')."""
    w = fact.split()
    subject = f"{w[1]} {w[2]}"
    if w[4] == "on":
        return subject, "place", w[6]
    if w[4] == "in":
        return subject, "holder", f"{w[6]} {w[7]}"
    return subject, "state", w[4]


def sentence(subject: str, kind: str, value: str) -> str:
    if kind == "place":
        return f"the {subject} is on the {value} ."
    if kind == "holder":
        return f"the {subject} is in the {value} ."
    return f"the {subject} is {value} ."


def answers(texts: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Facts in prompt order -> (latest place per container, latest holder per movable)."""
    place, holder = {}, {}
    for t in texts:
        subject, kind, value = parse(t)
        if kind == "place":
            place[subject] = value
        elif kind == "holder":
            holder[subject] = value
    return place, holder


def shape(n: int) -> tuple[int, int, int]:
    """(containers, movables, updates) of a stream of n facts (the world has 8 and 12)."""
    containers = min(8, max(2, n // 5))
    movables = min(12, max(2, n // 4))
    return containers, movables, max(0, n - containers - movables)


@dataclass
class Stream:
    facts: list[str]  # current text of fact/<i>
    rng: np.random.Generator
    hot: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, n: int, seed: int) -> Stream:
        rng = np.random.default_rng(seed)
        facts, _, _ = fact_stream(rng, *shape(n))
        subjects = sorted({parse(f)[0] for f in facts})
        hot = [subjects[i] for i in rng.permutation(len(subjects))[:HOT_SUBJECTS]]
        return cls(facts, rng, hot)

    def segments(self) -> list[tuple[str, str, str]]:
        """(segment id, text, group) of every fact, in arrival order."""
        return [(f"fact/{i}", f, parse(f)[0]) for i, f in enumerate(self.facts)]

    def update(self) -> tuple[str, str, str]:
        """Rewrite one latest fact in place -> (segment id, new text, group)."""
        latest = {}
        for i, f in enumerate(self.facts):
            subject, kind, _ = parse(f)
            latest[(subject, kind)] = i
        keys = sorted(latest)
        hot = [k for k in keys if k[0] in self.hot]
        pool = hot if hot and self.rng.random() < HOT_SHARE else keys
        subject, kind = pool[self.rng.integers(len(pool))]
        i = latest[(subject, kind)]
        _, _, old = parse(self.facts[i])
        if kind == "place":
            value = str(self.rng.choice([p for p in PLACES if p != old]))
        elif kind == "state":
            value = "closed" if old == "open" else "open"
        else:
            containers = sorted({parse(f)[0] for f in self.facts if parse(f)[1] == "place"})
            others = [c for c in containers if c != old] or containers
            value = others[self.rng.integers(len(others))]
        self.facts[i] = sentence(subject, kind, value)
        return f"fact/{i}", self.facts[i], subject

    def query(self, hops: int, texts: list[str]) -> tuple[str, str]:
        """A `hops`-hop query over the prompt's facts -> (query, answer)."""
        place, holder = answers(texts)
        if hops == 1:
            c = sorted(place)[self.rng.integers(len(place))]
            return f"where is the {c} ?", place[c]
        known = sorted(m for m, c in holder.items() if c in place)
        m = known[self.rng.integers(len(known))]
        return f"where is the {m} ?", place[holder[m]]
