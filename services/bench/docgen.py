"""Generated sections of committed docs: tables made from committed JSON, never typed by hand.

A doc marks each generated section with a pair of HTML comments (invisible in rendered
markdown)::

    <!-- generated: NAME (COMMAND): do not edit -->
    ...tables...
    <!-- end generated: NAME -->

``splice`` replaces what lies between the markers of ``NAME`` (appending the section when the
doc has none yet); ``update`` writes the doc, or with ``check`` only compares, so a unit test
can prove that the committed tables are exactly what the committed JSON generates.
``revision`` stamps a run with the commit it ran on.

Threading model: plain functions, no state.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def revision() -> str:
    """The checkout's short commit (``-`` outside git), to stamp a run's JSON with."""
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "-"
    return found.stdout.strip() or "-"


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
    return f"{text.rstrip()}\n\n{section}\n"


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
    """Write ``body`` into ``path``'s section ``name``; True if the file changed (or, with
    ``check``, would change: then raise ``DocOutOfDate`` instead of writing)."""
    old = path.read_text() if path.exists() else ""
    new = splice(old, name, body, command)
    if new == old:
        return False
    if check:
        raise DocOutOfDate(
            f"{path}: section {name!r} is not what its data generates; run `{command}`"
        )
    path.write_text(new)
    return True
