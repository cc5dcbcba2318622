"""The README's ``## Layout`` block matches the tree: every path it names exists, and it names
every top-level folder of the repository and every Python package folder of the code.

The block is the first fenced block after the ``## Layout`` heading. A line that starts in the
first column is a row; its first field is the row's folder (``schemas/``), and the lines indented
under it continue the row. A path is a token that ends in ``/`` (a folder) or in a file suffix
(``messages.py``, ``asyncapi.json``); it is relative to its row's folder (``vllm/`` in the
``connector/`` row is ``connector/vllm``). Words such as ``kvpush.schemas`` or ``push/pull`` are
not paths. The parser is checked on a small made-up block first, so a broken parser cannot pass
the real checks by finding nothing.

Top-level folders are those holding files git tracks (without git: every folder on disk), less
dot-folders, build outputs, ``models/`` and ``logs/``. Package folders are the folders with an
``__init__.py`` under ``schemas/``, ``connector/``, ``services/`` and ``benchmarks/``.

Threading model: none (pytest, one thread).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CODE_FOLDERS = ("schemas", "connector", "services", "benchmarks")
NOT_NAMED = frozenset({"models", "logs", "build", "dist", "test-output", "__pycache__"})
FILE_SUFFIXES = (".py", ".md", ".json", ".yaml", ".yml", ".toml", ".sh", ".conf")
# a run of path characters with at least one "/" or a file suffix; backticks and brackets end it
_PATH_TOKEN = re.compile(r"(?<![\w./-])[\w.-]+(?:/[\w.-]+)*/?")


def layout_block(readme_text: str) -> list[str]:
    """The lines of the first fenced block after the ``## Layout`` heading."""
    after = readme_text.split("\n## Layout\n", 1)[1]
    body = after.split("```", 2)[1]
    return body.split("\n")[1:]  # drop the rest of the opening fence's line


def layout_rows(block: list[str]) -> dict[str, str]:
    """Row folder (``schemas``) -> the row's text after the folder, continuation lines joined."""
    rows: dict[str, str] = {}
    folder = ""
    for line in block:
        if not line.strip():
            continue
        if not line[0].isspace():
            first, _, rest = line.partition(" ")
            assert first.endswith("/"), f"a Layout row must start with a folder: {line!r}"
            folder = first.rstrip("/")
            rows[folder] = rest
        else:
            assert folder, f"a continuation line before any row: {line!r}"
            rows[folder] += " " + line.strip()
    return rows


def named_paths(block: list[str]) -> set[str]:
    """Every path the block names, relative to the repository root (folders without ``/``)."""
    paths: set[str] = set()
    for folder, text in layout_rows(block).items():
        paths.add(folder)
        for token in _PATH_TOKEN.findall(text):
            if token.endswith("/") or token.endswith(FILE_SUFFIXES):
                paths.add(f"{folder}/{token.rstrip('/')}")
    return paths


def top_level_folders(root: Path) -> set[str]:
    """Top-level folders holding files git tracks (every folder on disk without git), less
    dot-folders and the folders that hold outputs or local models."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--cached", "-z"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        tops = {p.split("/", 1)[0] for p in listed.split("\0") if "/" in p and (root / p).exists()}
    except (OSError, subprocess.CalledProcessError):
        tops = {p.name for p in root.iterdir() if p.is_dir()}
    return {
        name
        for name in tops
        if not name.startswith(".") and name not in NOT_NAMED and not name.endswith(".egg-info")
    }


def package_folders(root: Path) -> set[str]:
    """Every folder with an ``__init__.py`` under the code folders, relative to ``root``."""
    return {
        init.parent.relative_to(root).as_posix()
        for folder in CODE_FOLDERS
        for init in (root / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_the_layout_parser_reads_rows_continuations_and_relative_paths() -> None:
    readme = """# x

## Layout

```text
lib/   kvpush.lib   the code: core.py (the core), sub/ (helpers, push/pull
                    and kvpush.lib words are not paths), sub/deep.py
docs/               guide.md; img/
```

## Next
```
other/  not in the block
```
"""
    block = layout_block(readme)
    assert list(layout_rows(block)) == ["lib", "docs"]
    assert named_paths(block) == {
        "lib",
        "lib/core.py",
        "lib/sub",
        "lib/sub/deep.py",
        "docs",
        "docs/guide.md",
        "docs/img",
    }


def test_every_path_the_layout_names_exists() -> None:
    named = named_paths(layout_block(README.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README's Layout names paths that do not exist: {missing}"


def test_every_top_level_folder_is_named_in_the_layout() -> None:
    named = named_paths(layout_block(README.read_text()))
    tops = top_level_folders(ROOT)
    assert {"schemas", "connector", "services", "tests"} <= tops  # the listing found the tree
    unnamed = sorted(tops - named)
    assert not unnamed, f"top-level folders missing from README's Layout: {unnamed}"


def test_every_package_folder_of_the_code_is_named_in_the_layout() -> None:
    named = named_paths(layout_block(README.read_text()))
    packages = package_folders(ROOT)
    assert "connector/vllm" in packages  # the walk found the packages
    unnamed = sorted(packages - named)
    assert not unnamed, f"package folders missing from README's Layout: {unnamed}"
