"""Parsing deploy/images/: Dockerfile instructions, ARG substitution, pip steps, .dockerignore
rules (Docker's matching, for the patterns used) and the Makefile's pinned versions."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.deploy.layout import IMAGES, ROOT


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined; comments and parser directives dropped."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        start = start or number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        keyword, _, value = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending, start = "", 0
    assert not pending, f"{path}: unterminated continuation"
    return instructions


def args_of(instructions: list[Instruction]) -> dict[str, str]:
    values = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            values[name] = default
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def makefile_var(name: str) -> str:
    match = re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, name
    return match[1]


DOCKERFILES: Final = {"cpu": IMAGES / "Dockerfile.cpu", "cuda": IMAGES / "Dockerfile.cuda"}


def pip_steps(path: Path) -> list[list[str]]:
    """Every ``pip install/uninstall`` of the file's RUN lines, ARGs substituted."""
    instructions = parse_dockerfile(path)
    values = args_of(instructions)
    steps = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for command in substitute(ins.value, values).split("&&"):
            words = shlex.split(command)
            if words[:1] == ["pip"]:
                steps.append(words[1:])
    return steps


def dockerignore_rules(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(rules: list[str], path: str) -> bool:
    """Docker's rule order for the patterns used: the last matching rule wins; a pattern
    matches the path or one of its parent folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for rule in rules:
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        pattern = pattern.removeprefix("**/")
        if any(
            fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p.split("/")[-1], pattern)
            for p in prefixes
        ):
            result = not negate
    return result
