"""The suite's tiers by cost (the Makefile's TIER_* folders and their test-* targets): every
test folder is in exactly one tier, the tiers together are what `make test` runs (pyproject's
testpaths), and the fast tier holds pure logic only: no engine, nats-server or browser.

Reads the Makefile, pyproject.toml and the test modules' source; starts nothing; one thread.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
TESTS: Final = ROOT / "tests"

# The fixtures of tests/conftest.py (the only conftest the fast tier sees) that start a
# nats-server or a child interpreter that imports vLLM.
COSTLY_FIXTURES: Final = frozenset({"nats_server", "bus", "in_child"})
# A vLLM import anywhere in the text (also in the code a test hands to a child interpreter),
# the embedded nats-server, the headless browser.
COSTLY_TEXT: Final = re.compile(
    r"^\s*(from vllm\b|import vllm\b)|\bEmbeddedNats\b|\bfrom tests import browser\b"
    r"|\btests\.browser\b",
    re.MULTILINE,
)


def makefile_tiers() -> dict[str, list[str]]:
    """``TIER_<NAME> := folder ...`` of the Makefile, by name."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {m[1]: m[2].split() for m in re.finditer(r"^TIER_(\w+) := (.+)$", text, re.MULTILINE)}


def suite_folders() -> list[str]:
    """pyproject.toml's testpaths: what a plain pytest (`make test`) runs."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r"^testpaths = (\[[^]]*\])", text, re.MULTILINE)
    assert match, "pyproject.toml: no testpaths"
    return json.loads(match[1])


def test_each_test_folder_is_in_exactly_one_tier_and_the_tiers_are_the_whole_suite() -> None:
    tiers = makefile_tiers()
    assert set(tiers) == {"FAST", "DOCS", "ENGINE", "E2E"}, tiers
    folders = Counter(f for members in tiers.values() for f in members)
    assert [f for f, n in folders.items() if n > 1] == []
    assert sorted(folders) == sorted(suite_folders())
    assert suite_folders()[-1] == "tests/e2e"  # its stack teardown stays out of the rest
    holding_tests = {p.parent.relative_to(ROOT).as_posix() for p in TESTS.rglob("test_*.py")} | {
        p.parent.relative_to(ROOT).as_posix() for p in TESTS.rglob("*_test.py")
    }
    outside = sorted(
        d for d in holding_tests if not any(d == f or d.startswith(f"{f}/") for f in folders)
    )
    assert outside == [], f"test modules in no tier (pytest never runs them): {outside}"


def test_each_tier_has_a_make_target_that_runs_only_that_tier() -> None:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = dict(re.findall(r"^(test-[a-z0-9]+): .*\n\t.*pytest (\$\(TIER_\w+\))", text, re.M))
    assert targets == {
        "test-fast": "$(TIER_FAST)",
        "test-docs": "$(TIER_DOCS)",
        "test-engine": "$(TIER_ENGINE)",
        "test-e2e": "$(TIER_E2E)",
    }


def costly_parts(path: Path) -> list[str]:
    """What in the module starts an engine, a nats-server or a browser."""
    source = path.read_text(encoding="utf-8")
    found = [f"text {m[0].strip()!r}" for m in COSTLY_TEXT.finditer(source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = {a.arg for a in node.args.args + node.args.kwonlyargs}
            found += [f"{node.name} asks for {n}" for n in sorted(names & COSTLY_FIXTURES)]
    return list(dict.fromkeys(found))


def test_costly_parts_are_found_in_a_module_that_uses_them(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(
        "CHILD = '''\nfrom vllm import SamplingParams\n'''\n"
        "async def test_a(nats_server, tmp_path): ...\n"
        "def test_b(in_child): ...\n"
        "def test_c(tmp_path): ...\n"
    )
    assert costly_parts(module) == [
        "text 'from vllm'",
        "test_a asks for nats_server",
        "test_b asks for in_child",
    ]


def test_the_fast_tier_starts_no_engine_nats_server_or_browser() -> None:
    fast = [ROOT / f for f in makefile_tiers()["FAST"]]
    costly = {
        p.relative_to(ROOT).as_posix(): parts
        for folder in fast
        for p in sorted(folder.rglob("*.py"))
        if (parts := costly_parts(p))
    }
    assert costly == {}, "move these to tests/integration (or tests/e2e for the browser)"
