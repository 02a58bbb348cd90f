"""The documentation stays true to the tree: every relative link of README.md and docs/*.md
resolves to a file inside the repository (and to a heading, where it names one), and every
`embodied-kv COMMAND`, `embodied-kv bench NAME` and `make TARGET` the README shows exists
(the CLI's own argparse parser, the benchmark modules, the Makefile's rules)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from embodied_kv import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def without_code(text: str) -> str:
    """The prose: fenced blocks and inline code spans removed (a link there is not one)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def code_of(text: str) -> list[str]:
    """The code a page shows: fenced blocks, indented blocks and inline code spans."""
    fenced = [m.group(0) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    indented = re.findall(r"(?:^(?: {4}|\t)[^\n]*\n?)+", rest, re.M)
    return fenced + indented + [m.group(2) for m in INLINE_CODE.finditer(rest)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(FENCE.sub("", text)):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list[str]:
    prose = without_code(text)
    return [m.group(1) for m in LINK.finditer(prose)] + REFERENCE.findall(prose)


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """What is wrong with the links of the page at `path` (its text: `text` or the file's)."""
    text = path.read_text() if text is None else text
    bad = []
    for target in links(text):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            bad.append(f"{target}: absolute path (use one relative to the page)")
            continue
        if not file_part:  # a heading of this page
            if anchor not in anchors(text):
                bad.append(f"{target}: no heading '#{anchor}' on this page")
            continue
        dest = (path.parent / file_part).resolve()
        if dest != ROOT and ROOT not in dest.parents:
            bad.append(f"{target}: leaves the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file or folder")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    assert broken_links(page) == []


def test_the_link_checker_catches_what_it_must():
    page = ROOT / "docs" / "__probe__.md"  # never written: only its text is parsed
    text = (
        "# Top\n[ok](../README.md) [up](../../shared/DESIGN.md) [gone](nothing.md)\n"
        "[abs](/etc/passwd) [web](https://example.com) [here](#top) [nohead](#nowhere)\n"
        "[head](../README.md#no-such-heading)\n"
        "`[code](../../x.md)`\n```\n[fenced](../../y.md)\n```\n"
    )
    bad = broken_links(page, text)
    assert len(bad) == 5, bad
    assert "leaves the repository" in bad[0] and "no such file" in bad[1]
    assert "absolute path" in bad[2] and "no heading '#nowhere' on this page" in bad[3]
    assert "no heading '#no-such-heading' in README.md" in bad[4]


def subcommands() -> set[str]:
    parser = cli.build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1, "cli.build_parser() has one set of subcommands"
    return set(actions[0].choices)


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    rules = re.findall(r"^([A-Za-z0-9_.-][A-Za-z0-9_. -]*):(?!=)", text, re.M)
    return {t for rule in rules for t in rule.split()}


CLI_USE = re.compile(
    r"(?:\bembodied-kv|\bembodied_kv\.cli)[ \t]+([A-Za-z][\w-]*)(?:[ \t]+([A-Za-z][\w-]*))?"
)
MAKE_USE = re.compile(r"(?:^|[;&|(]\s*|\s)make[ \t]+((?:[A-Z_]+=\S*[ \t]+)*)([a-z][\w-]*)", re.M)


def readme_commands() -> tuple[set[tuple[str, str | None]], set[str]]:
    code = "\n".join(code_of(README.read_text()))
    used = {(m.group(1), m.group(2)) for m in CLI_USE.finditer(code) if not m.group(1).isupper()}
    return used, {m.group(2) for m in MAKE_USE.finditer(code)}


def test_every_command_the_readme_shows_exists():
    used, targets = readme_commands()
    assert used and targets, "the README shows its commands in code"
    commands, benches = subcommands(), set(cli.available_benchmarks())
    missing = sorted(f"embodied-kv {c}" for c, _ in used if c not in commands)
    missing += sorted(
        f"embodied-kv bench {n}" for c, n in used if c == "bench" and n and not n.isupper()
        and n.replace("-", "_") not in benches
    )  # fmt: skip
    missing += sorted(f"make {t}" for t in targets - make_targets())
    assert missing == []


def test_the_readme_shows_the_two_commands():
    _, targets = readme_commands()
    assert {"demo", "test"} <= targets
