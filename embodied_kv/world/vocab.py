"""The world's closed vocabulary: every word any world text (prompt, question, answer,
fact, narration) uses, so a tiny word-level tokenizer covers it without unknowns."""

from __future__ import annotations

COLOURS = ("red", "green", "blue", "yellow")
MOVABLES = ("block", "ball", "key")  # shapes the gripper can pick up
CONTAINERS = ("bowl", "box")  # shapes that hold movables
PLACES = ("table", "shelf", "drawer", "floor", "sink")  # where containers are, in memory facts
NUMBERS = ("zero", "one", "two", "three", "four", "five")

# The prompt frame (model/prompt.py, engine/policy.py) and the world's sentences.
FRAME_WORDS = ("Task", "State", "Action", "Question", "Answer", "Facts", "Query")
WORDS = (
    "the", "put", "in", "on", "is", "are", "what", "colour", "where", "how", "many",
    "objects", "there", "left", "right", "of", "yes", "no", "open", "closed", "arm", "moves",
    "to", "lowers", "grasps", "carries", "releases", "done", "nothing",
)  # fmt: skip
PUNCTUATION = (".", ",", ":", ";", "?")
STATE_NUMBERS = tuple(str(i) for i in range(256))  # the prompt's discretised state bins
# words added after weights shipped: appended after every earlier id, so those ids stay
LATER_WORDS = ("middle",)


def vocabulary() -> list[str]:
    """Every word, in a fixed order (the tokenizer's ids follow it), without repeats."""
    seen: dict[str, None] = {}
    for group in (FRAME_WORDS, WORDS, COLOURS, MOVABLES, CONTAINERS, PLACES, NUMBERS,
                  PUNCTUATION, STATE_NUMBERS, LATER_WORDS):  # fmt: skip
        for w in group:
            seen.setdefault(w, None)
    return list(seen)


def number_word(n: int) -> str:
    if not 0 <= n < len(NUMBERS):
        raise ValueError(f"no number word for {n}; known 0..{len(NUMBERS) - 1}")
    return NUMBERS[n]
