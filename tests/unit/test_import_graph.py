"""The import graph of ``kvpush``: layers run one way (schemas < connector < services <
benchmarks), services use the connector's public module only, and no module imports itself
through a circle.

The runtime (schemas, connector, services) never imports ``kvpush.benchmarks``, with one named
exception: ``kvpush bench`` itself, whose dispatch function in services/cli.py imports
``kvpush.benchmarks.cli`` when it runs (:data:`BENCH_DISPATCH`). The exception is one
(module, function, target) triple, not a module: an import of the benchmarks anywhere else in
cli.py, at its module level included, is a violation; and the test checks that the dispatch
still imports exactly that, and that building the parser and parsing ``bench ...`` leaves the
benchmarks unimported.

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
FOLDERS = ("schemas", "connector", "services", "benchmarks")
RUNTIME = ("kvpush.schemas", "kvpush.connector", "kvpush.services")
PUBLIC_CONNECTOR = "kvpush.connector"
BENCHMARKS = "kvpush.benchmarks"
# (module, function, the one module it may import from the benchmarks): the lazy `kvpush bench`
BENCH_DISPATCH = ("kvpush.services.cli", "_cmd_bench", "kvpush.benchmarks.cli")
# source module -> imported module -> the functions that import it ("" = module or class level)
Edges = dict[str, dict[str, set[str]]]


def modules(root: Path) -> dict[str, Path]:
    """``kvpush.<folder>...`` module name -> its file, for every file of the :data:`FOLDERS`."""
    found: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["kvpush", *parts])] = path
    return found


def import_statements(
    tree: ast.AST, path: str = "", in_function: bool = False
) -> list[tuple[str, ast.stmt]]:
    """Every import statement under ``tree`` with the function holding it (its dotted path,
    classes included: ``Class.method``; "" at module or class level, which runs on import)."""
    found: list[tuple[str, ast.stmt]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((path if in_function else "", node))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            inner = f"{path}.{node.name}" if path else node.name
            function = in_function or not isinstance(node, ast.ClassDef)
            found.extend(import_statements(node, inner, function))
        else:
            found.extend(import_statements(node, path, in_function))
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> dict[str, set[str]]:
    """The kvpush modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``), each
    with the functions that import it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[tuple[str, str]] = []
    for scope, node in import_statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.extend((alias.name, scope) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append((full if full in known else base, scope))
    resolved: dict[str, set[str]] = {}
    for target, scope in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.setdefault(target, set()).add(scope)
    return resolved


def graph(root: Path) -> Edges:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def benchmark_violations(source: str, target: str, scopes: set[str]) -> list[str]:
    """A runtime module importing the benchmarks: one line per importing place, except the
    :data:`BENCH_DISPATCH` function importing its one module."""
    if not source.startswith(RUNTIME) or not target.startswith(BENCHMARKS):
        return []
    allowed = {BENCH_DISPATCH[1]} if (source, target) == BENCH_DISPATCH[::2] else set()
    return [
        f"{source} -> {target} (benchmarks in the runtime: {scope or 'module level'})"
        for scope in sorted(scopes - allowed)
    ]


def layer_violations(edges: Edges) -> list[str]:
    found = []
    for source, targets in sorted(edges.items()):
        for target, scopes in sorted(targets.items()):
            found.extend(benchmark_violations(source, target, scopes))
            lower = source.startswith(("kvpush.schemas", "kvpush.connector"))
            if lower and target.startswith("kvpush.services"):
                found.append(f"{source} -> {target} (a lower layer imports services)")
            if source.startswith("kvpush.schemas") and target.startswith("kvpush.connector"):
                found.append(f"{source} -> {target} (schemas import the connector)")
            internal = target.startswith(PUBLIC_CONNECTOR + ".")
            if source.startswith("kvpush.services") and internal:
                found.append(f"{source} -> {target} (not through {PUBLIC_CONNECTOR})")
    return found


def cycles(edges: Edges) -> list[list[str]]:
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
            "services/cli.py": "import kvpush.benchmarks\n"
            "def _cmd_bench():\n    from kvpush.benchmarks import cli\n"
            "def _cmd_other():\n    from kvpush.benchmarks import cli\n",
            "benchmarks/__init__.py": "",
            "benchmarks/cli.py": "from kvpush.services import t\nfrom kvpush.connector import x\n",
            "benchmarks/b.py": "class B:\n    def run(self):\n        import kvpush.schemas.a\n"
            "from kvpush.connector.x import y\n",
            "connector/z.py": "class Z:\n    def f(self):\n        import kvpush.benchmarks.b\n",
        },
    )
    edges = graph(tmp_path)
    assert edges["kvpush.services.t"] == {"kvpush.services.s": {""}}  # relative import resolved
    assert edges["kvpush.benchmarks.b"] == {
        "kvpush.schemas.a": {"B.run"},
        "kvpush.connector.x": {""},
    }
    assert layer_violations(edges) == [
        "kvpush.connector.x -> kvpush.services.s (a lower layer imports services)",
        "kvpush.connector.z -> kvpush.benchmarks.b (benchmarks in the runtime: Z.f)",
        "kvpush.schemas.a -> kvpush.connector.x (schemas import the connector)",
        "kvpush.services.cli -> kvpush.benchmarks (benchmarks in the runtime: module level)",
        "kvpush.services.cli -> kvpush.benchmarks.cli (benchmarks in the runtime: _cmd_other)",
        "kvpush.services.s -> kvpush.connector.x (not through kvpush.connector)",
    ]
    assert cycles(edges) == [["kvpush.connector.x", "kvpush.services.s", "kvpush.services.t"]]


def test_layers_run_one_way_and_services_use_the_public_connector_module() -> None:
    edges = graph(ROOT)
    assert len(edges) > 60, "the analyzer found too few modules: wrong root?"
    assert any(name.startswith(BENCHMARKS) for name in edges), "benchmarks/ not read"
    assert layer_violations(edges) == []


def test_the_runtime_imports_the_benchmarks_only_in_the_bench_dispatch() -> None:
    source, function, target = BENCH_DISPATCH
    runtime_to_benchmarks = {
        (name, imported): scopes
        for name, targets in graph(ROOT).items()
        if name.startswith(RUNTIME)
        for imported, scopes in targets.items()
        if imported.startswith(BENCHMARKS)
    }
    assert runtime_to_benchmarks == {(source, target): {function}}


def test_parsing_a_bench_command_leaves_the_benchmarks_unimported() -> None:
    code = (
        "import sys\n"
        "from kvpush.services import cli\n"
        "cli.build_parser().parse_args(['bench', 'serve', '--quick'])\n"
        "sys.exit(any(name.startswith('kvpush.benchmarks') for name in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_no_import_cycles() -> None:
    assert cycles(graph(ROOT)) == []


@pytest.mark.parametrize("module", ["kvpush.connector", "kvpush.services.gateway"])
def test_the_public_modules_do_not_import_vllm(module: str) -> None:
    code = f"import sys, {module}; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
