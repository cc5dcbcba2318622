"""Citations of docs/design.md point at something that is there.

Code and docs cite the design as ``docs/design.md, <section>`` (``docs/design.md, flow``) or
``docs/design.md, correctness rule N`` (also ``rules N and M``, ``rules N-M``), and link it as
``design.md#<anchor>``. Every section named must be a ``##`` heading of docs/design.md, every
rule number one of its numbered correctness rules, every anchor a heading's GitHub anchor, and
nothing cites the old out-of-repo document (its name in capitals and a section sign) any
more. Citations may wrap across lines: whitespace is collapsed before matching. The matcher is
checked on made-up text first, and this file's own examples are not scanned.

Threading model: none (pytest, one thread).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN_DOC = ROOT / "docs" / "design.md"
SUFFIXES = (".py", ".md", ".toml")
SKIPPED = frozenset({"models", "logs", "build", "dist", "test-output", "__pycache__"})
RULES_SECTION = "correctness rules"
_CITATION = re.compile(
    r"docs/design\.md, (?:(correctness) rules? (\d+)(?:(?: and |-)(\d+))?|([a-z]+(?: [a-z]+)*))"
)
_ANCHOR = re.compile(r"design\.md#([\w-]+)")


def cited(text: str) -> tuple[set[str], set[int], set[str]]:
    """The sections, rule numbers and ``design.md#`` anchors ``text`` cites."""
    flat = re.sub(r"\s+", " ", text)
    sections: set[str] = set()
    rules: set[int] = set()
    for rule_word, first, last, section in _CITATION.findall(flat):
        if rule_word:
            rules.update(range(int(first), int(last or first) + 1))
        if rule_word or section.startswith("correctness rule"):
            sections.add(RULES_SECTION)  # also "correctness rule N": the rules, no number
        else:
            sections.add(section)
    return sections, rules, set(_ANCHOR.findall(flat))


def headings(design_text: str) -> dict[str, str]:
    """``##`` heading, lowercased -> its GitHub anchor."""
    found = {}
    for line in design_text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            found[title.lower()] = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    return found


def rule_numbers(design_text: str) -> set[int]:
    """The numbers of the list items under the correctness rules heading."""
    section = design_text.split("\n## Correctness rules\n", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)}


def repo_files() -> list[Path]:
    """The code and docs files of the repository, less this test (its examples are made up)."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d for d in dirs if not d.startswith(".") and d not in SKIPPED and "egg-info" not in d
        ]
        found += [Path(folder, name) for name in names if name.endswith(SUFFIXES)]
    return [path for path in found if path != Path(__file__).resolve()]


def test_the_matcher_reads_sections_rule_ranges_and_wrapped_anchors() -> None:
    text = """(docs/design.md, correctness rules 3 and 4) and (docs/design.md,
    correctness rule 8); [docs/design.md, measured
    facts](../design.md#measured-facts), docs/design.md, correctness rules 1-2; the form
    docs/design.md, correctness rule N."""
    assert cited(text) == ({RULES_SECTION, "measured facts"}, {1, 2, 3, 4, 8}, {"measured-facts"})
    design = "# t\n\n## Flow\n\n## Correctness rules\n\n1. a\n2. b\n\n## Measured facts\n"
    assert headings(design)["correctness rules"] == "correctness-rules"
    assert rule_numbers(design) == {1, 2}


def test_every_design_citation_names_a_section_rule_and_anchor_that_exist() -> None:
    design_text = DESIGN_DOC.read_text()
    sections = headings(design_text)
    anchors, rules = set(sections.values()), rule_numbers(design_text)
    assert rules and rules == set(range(1, len(rules) + 1)), "rules are numbered 1..N"
    files = repo_files()
    assert any(path.name == "transfer.py" for path in files)  # the walk found the code
    problems = []
    for path in files:
        text = path.read_text(errors="replace")
        names, numbers, links = cited(text)
        if path == DESIGN_DOC:  # its own links to its sections
            links |= set(re.findall(r"\]\(#([\w-]+)\)", text))
        where = path.relative_to(ROOT)
        problems += [f"{where}: no section {n!r}" for n in sorted(names - set(sections))]
        problems += [f"{where}: no correctness rule {n}" for n in sorted(numbers - rules)]
        problems += [f"{where}: no anchor #{a}" for a in sorted(links - anchors)]
    assert not problems, "\n".join(problems)


def test_nothing_cites_the_design_document_outside_the_repo() -> None:
    old = [
        str(path.relative_to(ROOT))
        for path in repo_files()
        if "DESIGN" + " \N{SECTION SIGN}" in path.read_text(errors="replace")
    ]
    assert not old, f"still citing the old design document: {old}"
