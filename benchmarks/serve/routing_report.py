"""The routing benchmark's tables (issue 32): TTFT and TPOT per system and point, ratios.

``kvpush bench serve --systems kvpush-routed,kvpush-least-loaded,vllm-serve,... --tables
reuse50:1024,reuse90:1024 --client vllm --out-dir docs/benchmarks/routing`` writes
``results.json``; ``body`` turns it into the section ``routing`` of
``docs/benchmarks/routing/results.md`` (the H200's run: ``h200.json`` into ``h200.md``;
``kvpush.benchmarks.docgen`` markers; the prose
around it is left alone): per table (reuse share, prompt length) one row per point and system
with TTFT P50 and P99 and the mean TPOT (ms, median and [min-max] over repeats: a route that
prefills on a busy D shows in its running answers' TPOT), then the TTFT ratios peer /
``kvpush-routed`` of those medians (above 1: kvpush-routed is faster; a table with only the
1P1D row ``kvpush-routed-1p1d``: peers / it), then, when the run
recorded them (``Point.routing``: runs before it did not, and their section has none), the
kvpush systems' routing decisions per point (``decision_lines``): the requests per
``mode/reason`` summed over repeats, each group's TTFT P50 next to the cost model's estimate
P50 (medians over repeats) and the requests per decode worker; then the kvpush systems' TTFT
breakdown (P50 of each part, as ``kvpush bench report`` shows it). Rows come from
``summary.rows``, as ``kvpush bench report``'s do; nothing here depends on the time of day.

Regenerate: ``python -m kvpush.benchmarks.serve.routing_report RESULTS DOC`` (``--check``:
exit 1 when the doc differs from what the results generate).

Threading model: pure functions, plus file reads and writes in ``write_doc`` and ``main``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen
from kvpush.benchmarks.serve import results as results_mod
from kvpush.benchmarks.serve import summary
from kvpush.benchmarks.serve.report import (
    _breakdown_lines,
    _cell,
    _num,
    _point_label,
    _ratio,
    failed_lines,
)
from kvpush.benchmarks.serve.results import Document, Point
from kvpush.benchmarks.serve.summary import Row

SECTION = "routing"
ROUTED = "kvpush-routed"  # the reference of every ratio
REFERENCES = (ROUTED, "kvpush-routed-1p1d")  # the first a table has (the 1P1D row alone: it)
FIGURES = ("ttft_p50", "ttft_p99")
FOLDER = "docs/benchmarks/routing"  # the committed runs: results.json (CPU), h200.json
REPORT_COMMAND = (
    f"python -m kvpush.benchmarks.serve.routing_report {FOLDER}/results.json {FOLDER}/results.md"
)


def report_command(results_path: Path, doc_path: Path) -> str:
    """The marker's command for a run committed in ``FOLDER`` (``REPORT_COMMAND`` for the CPU
    run's ``results.json`` -> ``results.md``; the H200's ``h200.json`` -> ``h200.md``)."""
    return (
        "python -m kvpush.benchmarks.serve.routing_report "
        f"{FOLDER}/{results_path.name} {FOLDER}/{doc_path.name}"
    )


TABLE_TITLES = {
    "reuse50": "50% reuse",
    "reuse90": "90% reuse",
    "chat": "multi-turn chat, shared system prompt",
    "prefix": "50% shared prefix",
}


def _median(row: Row | None, figure: str) -> float | None:
    value = None if row is None else row.figures.get(figure)
    return None if value is None else value.median


def ratio_of(peer: Row, routed: Row | None, figure: str) -> float | None:
    """``peer``'s median over ``routed``'s (above 1: routed is faster); None without both."""
    ours, theirs = _median(routed, figure), _median(peer, figure)
    if ours is None or theirs is None or ours <= 0:
        return None
    return theirs / ours


def _meta_lines(document: Document) -> list[str]:
    meta = document.meta
    systems = ", ".join(
        n for n, s in document.systems.items() if not isinstance(s, dict) or s.get("ok")
    )
    lines = [f"Systems: {systems or '—'}."]
    keys = ("device", "gpu", "model", "client", "repeats", "output_len")
    shown = []
    for key in keys:
        value = meta.get(key)
        if isinstance(value, dict):
            value = value.get("name") or value.get("path")
        if value not in (None, ""):
            shown.append(f"{key.replace('_', ' ')} {value}")
    if shown:
        lines.append("Run: " + ", ".join(shown) + ".")
    share, decode = meta.get("gpu_memory_utilization"), meta.get("decode_gpu_memory_utilization")
    if share is not None:  # cuda
        by = ", ".join(f"{k} {v}" for k, v in share.items()) if isinstance(share, dict) else None
        text = f"GPU memory share (`--gpu-memory-utilization`): {by or f'{share:g}'}"
        text += " (a one-engine peer's engine gets twice it)"
        if decode is not None:
            text += f"; kvpush's decode engine {decode:g}"
        lines.append(text + ".")
    lines += _environment_lines(meta)
    return [*lines, ""]


def _environment_lines(meta: dict[str, Any]) -> list[str]:
    """The ``KVPUSH_*`` settings kvpush's systems ran with (each part's where they differ)."""
    if env := results_mod.environment_text(meta.get("kvpush_env")):
        return [f"kvpush's settings from the environment: {env}."]
    return [
        f"kvpush's settings from the environment in part {n} ({', '.join(part['ran'])}): "
        f"{results_mod.part_environment_text(part['kvpush_env'])}."
        for n, part in enumerate(meta.get("parts") or [], 1)
        if "kvpush_env" in part
    ]


def table_lines(dataset: str, input_len: int, rows: list[Row]) -> list[str]:
    """One table's TTFT rows and, below, the ratios peer / kvpush-routed of each point."""
    title = TABLE_TITLES.get(dataset, dataset)
    lines = [f"### {title}, {input_len}-token prompts (`{dataset}:{input_len}`)", ""]
    lines += [
        "| point | system | TTFT P50 (ms) | TTFT P99 (ms) | TPOT mean (ms) | done/err |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        p50, p99, tpot = (_cell(r.figures.get(f)) for f in (*FIGURES, "tpot_mean"))
        lines.append(
            f"| {_point_label(r)} | {r.system} | {p50} | {p99} | {tpot} | "
            f"{r.completed}/{r.errors} |"
        )
    lines.append("")
    names = {r.system for r in rows}
    reference = next((name for name in REFERENCES if name in names), ROUTED)
    routed = {r.point: r for r in rows if r.system == reference}
    peers = [r for r in rows if r.system != reference]
    if not routed or not peers:
        return lines
    lines += [f"Ratios peer / {reference} of the medians (above 1: {reference} is faster):", ""]
    lines += ["| point | peer | TTFT P50 | TTFT P99 |", "|---|---|---|---|"]
    for r in peers:
        cells = " | ".join(_ratio(ratio_of(r, routed.get(r.point), f)) for f in FIGURES)
        lines.append(f"| {_point_label(r)} | {r.system} | {cells} |")
    return [*lines, ""]


def _summed(counts: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for found in counts:
        for key, count in found.items():
            total[key] = total.get(key, 0) + int(count)
    return total


def _median_of(groups: list[dict[str, Any]], key: str, figure: str) -> str:
    found = [g[key][figure] for g in groups if key in g and g[key].get(figure) is not None]
    return _num(statistics.median(found)) if found else "—"


def decision_cells(routings: list[dict[str, Any]]) -> tuple[str, str, str]:
    """One point's repeats (a ``Point.routing`` each): the requests per mode/reason (summed
    over repeats), TTFT P50 vs estimate P50 per mode/reason (ms, medians over repeats) and the
    requests per decode worker (summed); a dash for what no repeat has. A repeat whose rows the
    gateway's ring could not all hold says so in the first cell ("ring held 200 of 480")."""
    groups = [r.get("groups") or {} for r in routings]
    counts = _summed([{k: g.get("count", 0) for k, g in found.items()} for found in groups])
    decode = _summed([r.get("decode") or {} for r in routings])
    timed = (
        f"{k} {_median_of(groups, k, 'ttft_p50_ms')} vs {_median_of(groups, k, 'estimate_p50_ms')}"
        for k in sorted(counts)
    )
    held = [shown for r in routings if (shown := results_mod.ring_partial(r))]
    note = f" (ring held {', '.join(held)})" if held else ""
    return (
        (", ".join(f"{k}: {n}" for k, n in sorted(counts.items())) or "—") + note,
        ", ".join(timed) or "—",
        ", ".join(f"{k} {n}" for k, n in sorted(decode.items())) or "—",
    )


def decision_lines(rows: list[Row], points: list[Point]) -> list[str]:
    """The routing decisions of the rows (a table's) whose points recorded them; none else."""
    recorded: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in sorted(points, key=lambda p: p.repeat):
        if p.routing:
            recorded.setdefault((p.point, p.system), []).append(p.routing)
    shown = [r for r in rows if (r.point, r.system) in recorded]
    if not shown:
        return []
    lines = [
        "Decisions of the kvpush systems: the gateway's routing per point (requests per "
        "mode/reason summed over repeats; TTFT P50 vs the cost model's estimate P50, ms, "
        "medians over repeats):",
        "",
        "| point | system | mode/reason: requests | TTFT P50 vs estimate P50 (ms) "
        "| requests per decode worker |",
        "|---|---|---|---|---|",
    ]
    for r in shown:
        cells = " | ".join(decision_cells(recorded[(r.point, r.system)]))
        lines.append(f"| {_point_label(r)} | {r.system} | {cells} |")
    return [*lines, ""]


def body(document: Document) -> str:
    """The generated section (no markers)."""
    all_rows = summary.rows(document)
    lines = ["## Results (generated)", "", *_meta_lines(document)]
    for dataset, input_len in summary.tables(document):
        rows = [r for r in all_rows if r.table == (dataset, input_len)]
        lines += table_lines(dataset, input_len, rows)
        points = [p for p in document.points if (p.dataset, p.input_len) == (dataset, input_len)]
        lines += decision_lines(rows, points)
        lines += _breakdown_lines(rows)
    lines += failed_lines(document)
    return "\n".join(lines).rstrip() + "\n"


def write_doc(doc_path: Path, results_path: Path, check: bool = False) -> bool:
    """Write (``check``: compare) ``doc_path``'s section; True if the file changed."""
    text = body(results_mod.load(results_path))
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    command = report_command(results_path, doc_path)
    return docgen.update(doc_path, SECTION, text, command, check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("doc", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    try:
        changed = write_doc(args.doc, args.results, args.check)
    except docgen.DocOutOfDate as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{'wrote' if changed else 'unchanged:'} {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
