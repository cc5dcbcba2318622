"""The import graph of ``kvpush``: layers run one way, services use the connector's public
module only, and no module imports itself through a circle.

The graph is read from the source with ``ast`` (every ``import``, also inside functions and
under ``TYPE_CHECKING``: a circle of type-only imports is still a circle to a reader), so the
test needs no vLLM and runs in a second. The analyzer is checked on a small made-up tree first,
so a broken analyzer cannot pass the real check by finding nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "connector", "services")
PUBLIC_CONNECTOR = "kvpush.connector"


def modules(root: Path) -> dict[str, Path]:
    """``kvpush.<folder>...`` module name -> its file, for every file of the three folders."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["kvpush", *parts])] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvpush modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in known else base)
    resolved: set[str] = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            lower = source.startswith(("kvpush.schemas", "kvpush.connector"))
            if lower and target.startswith("kvpush.services"):
                found.append(f"{source} -> {target} (a lower layer imports services)")
            if source.startswith("kvpush.schemas") and target.startswith("kvpush.connector"):
                found.append(f"{source} -> {target} (schemas import the connector)")
            internal = target.startswith(PUBLIC_CONNECTOR + ".")
            if source.startswith("kvpush.services") and internal:
                found.append(f"{source} -> {target} (not through {PUBLIC_CONNECTOR})")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in edges), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_analyzer_finds_a_planted_violation_and_circle(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "schemas/__init__.py": "",
            "schemas/a.py": "from kvpush.connector import x\n",
            "connector/__init__.py": "",
            "connector/x.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from kvpush.services.s import S\n",
            "services/__init__.py": "",
            "services/s.py": "def f():\n    from kvpush.connector.x import y\n"
            "from kvpush.services import t\n",
            "services/t.py": "from . import s\n",
        },
    )
    edges = graph(tmp_path)
    assert edges["kvpush.services.t"] == {"kvpush.services.s"}  # relative import resolved
    assert layer_violations(edges) == [
        "kvpush.connector.x -> kvpush.services.s (a lower layer imports services)",
        "kvpush.schemas.a -> kvpush.connector.x (schemas import the connector)",
        "kvpush.services.s -> kvpush.connector.x (not through kvpush.connector)",
    ]
    assert cycles(edges) == [["kvpush.connector.x", "kvpush.services.s", "kvpush.services.t"]]


def test_layers_run_one_way_and_services_use_the_public_connector_module() -> None:
    edges = graph(ROOT)
    assert len(edges) > 60, "the analyzer found too few modules: wrong root?"
    assert layer_violations(edges) == []


def test_no_import_cycles() -> None:
    assert cycles(graph(ROOT)) == []


@pytest.mark.parametrize("module", ["kvpush.connector", "kvpush.services.gateway"])
def test_the_public_modules_do_not_import_vllm(module: str) -> None:
    code = f"import sys, {module}; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
