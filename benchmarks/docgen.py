"""Generated sections of committed docs: tables made from committed JSON, never typed by hand.

A doc marks each generated section with a pair of HTML comments (invisible in rendered
markdown)::

    <!-- generated: NAME (COMMAND): do not edit -->
    ...tables...
    <!-- end generated: NAME -->

``splice`` replaces what lies between the markers of ``NAME`` (appending the section when the
doc has none yet); ``update`` writes the doc, or with ``check`` only compares, so a unit test
can prove that the committed tables are exactly what the committed JSON generates.
``publish`` is what a ``--report`` command does with a generated body; ``table`` renders a
markdown table; ``revision`` and ``stamp`` stamp a run with the code it ran and its date.

Threading model: plain functions, no state.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any


def revision() -> str:
    """The commit to stamp a run with: ``KVPUSH_REVISION`` when set (a copied tree, e.g. on a
    lent GPU host, whose git metadata, if any, is not the tree's), else the checkout's short
    commit, ``-dirty`` when tracked files differ from it (``-`` outside git)."""
    given = os.environ.get("KVPUSH_REVISION", "").strip()
    if given:
        return given
    given = "-"
    try:
        found = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return given
    return (found.stdout.strip() if found.returncode == 0 else "") or given


def stamp() -> str:
    """Now, as runs are dated in their JSON (UTC, to the minute)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table (cells as given, ``str()`` of each)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class DocOutOfDate(RuntimeError):
    """The committed doc's generated section differs from what its data generates."""


def _markers(name: str, command: str) -> tuple[str, str]:
    return (
        f"<!-- generated: {name} ({command}): do not edit -->",
        f"<!-- end generated: {name} -->",
    )


def splice(text: str, name: str, body: str, command: str) -> str:
    """``text`` with the generated section ``name`` holding ``body``."""
    begin, end = _markers(name, command)
    section = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(
        rf"<!-- generated: {re.escape(name)} \(.*?\): do not edit -->.*?{re.escape(end)}",
        re.DOTALL,
    )
    if pattern.search(text):
        return pattern.sub(lambda _: section, text, count=1)
    return f"{text.rstrip()}\n\n{section}\n" if text.strip() else f"{section}\n"


def section(text: str, name: str) -> str | None:
    """The body of the generated section ``name`` in ``text`` (None: there is none)."""
    _, end = _markers(name, "")
    found = re.search(
        rf"<!-- generated: {re.escape(name)} \(.*?\): do not edit -->\n(.*?)\n{re.escape(end)}",
        text,
        re.DOTALL,
    )
    return found.group(1) if found else None


def update(path: Path, name: str, body: str, command: str, check: bool = False) -> bool:
    """Write ``body`` into ``path``'s section ``name``; True if the file changed. With
    ``check``: write nothing, raise ``DocOutOfDate`` if the section's body differs (the command
    in its marker may name other paths: it is not compared)."""
    old = path.read_text() if path.exists() else ""
    if check:
        if section(old, name) != body.strip():
            raise DocOutOfDate(
                f"{path}: section {name!r} is not what its data generates; run `{command}`"
            )
        return False
    new = splice(old, name, body, command)
    if new == old:
        return False
    path.write_text(new)
    return True


def publish(body: str, doc: str | None, name: str, command: str, check: bool = False) -> int:
    """What a ``--report ... [--doc FILE] [--check]`` command does with a generated ``body``:
    print it (no ``doc``), or write it into ``doc``'s section ``name``, or only check it; the
    command's exit code (1: ``check`` found the doc out of date)."""
    if not doc:
        print(body)
        return 0
    try:
        changed = update(Path(doc), name, body, command, check)
    except DocOutOfDate as exc:
        print(exc)
        return 1
    print(f"{doc}: {'updated' if changed else 'up to date'}")
    return 0


def publish_report(
    args: Any, table: Callable[[dict[str, Any]], str], name: str, command: str
) -> int:
    """``--report FILE [--doc DOC] [--check]`` of a benchmark whose results are one JSON file:
    ``table`` of FILE's data, then ``publish``."""
    body = table(json.loads(Path(args.report).read_text()))
    return publish(body, args.doc, name, command, args.check)
