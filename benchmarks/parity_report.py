"""docs/api.md's parity table, generated from the parity suite's outcomes (JSON).

``tests/e2e/test_parity.py`` (run with ``KVPUSH_PARITY_OUT=docs/benchmarks/parity.json``)
records, per case, what ``vllm serve`` answered and whether kvpush answered the same in push
and in pull (and whether its KV came from P). ``python -m kvpush.benchmarks.parity_report
JSON --doc docs/api.md [--check]`` writes (or checks) the table.

Threading model: plain functions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen

NAME = "parity"
COMMAND = "python -m kvpush.benchmarks.parity_report docs/benchmarks/parity.json --doc docs/api.md"


def body(data: dict[str, Any]) -> str:
    rows = []
    for case in data["cases"]:
        kv = ", ".join(sorted({*case.get("push_kv", []), *case.get("pull_kv", [])})) or "-"
        rows.append(
            (case["feature"], f"`{case['path']}`", case["vllm"], case["push"], case["pull"], kv)
        )
    same = sum(1 for c in data["cases"] if c["push"] == c["pull"] == "same")
    head = f"{same} of {len(data['cases'])} cases answer as `vllm serve` in push and in pull.\n\n"
    headers = ("feature", "route", "vllm serve", "kvpush push", "kvpush pull", "KV from P")
    return head + docgen.table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the parity suite's outcomes")
    parser.add_argument("--doc", help="write the table into this doc's generated section")
    parser.add_argument("--check", action="store_true", help="only check the doc is current")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    return docgen.publish(body(data), args.doc, NAME, COMMAND, args.check)


if __name__ == "__main__":
    raise SystemExit(main())
