"""The results of ``kvpush bench serve``: ratios, the markdown table and the plots.

Input is the run's JSON document (``run.py`` builds it): ``points`` is a list of one dict per
(system, dataset, input length, load point) with the ``loadgen.summarize`` numbers and, for
kvpush systems, the TTFT breakdown. ``ratios`` compares ``kvpush-push`` with every other system
at every shared point (other / kvpush-push: above 1 means kvpush-push is that many times
better). ``markdown`` renders one table per dataset and input length plus the ratio table;
``plots`` writes one PNG per dataset and input length.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvpush.services.bench.serve.plot import ttft_chart
from kvpush.services.telemetry.breakdown import PART_NAMES

REFERENCE = "kvpush-push"


def _key(point: dict[str, Any]) -> tuple[str, int, str]:
    return point["dataset"], point["input_len"], point["label"]


def _ratio(other: float | None, ours: float | None) -> float | None:
    if other is None or ours is None or ours <= 0:
        return None
    return round(other / ours, 3)


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = {_key(p): p for p in points if p["system"] == REFERENCE}
    result = []
    for p in points:
        mine = ours.get(_key(p))
        if p["system"] == REFERENCE or mine is None:
            continue
        row: dict[str, Any] = {
            "dataset": p["dataset"],
            "input_len": p["input_len"],
            "label": p["label"],
            "vs": p["system"],
        }
        for stat in ("mean", "p50", "p99"):
            row[f"ttft_{stat}"] = _ratio(p["ttft_ms"][stat], mine["ttft_ms"][stat])
        row["tpot_mean"] = _ratio(p["tpot_ms"]["mean"], mine["tpot_ms"]["mean"])
        result.append(row)
    return result


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _groups(points: list[dict[str, Any]]) -> Iterable[tuple[str, int, list[dict[str, Any]]]]:
    keys = sorted({(p["dataset"], p["input_len"]) for p in points})
    for dataset, input_len in keys:
        yield (
            dataset,
            input_len,
            [p for p in points if p["dataset"] == dataset and p["input_len"] == input_len],
        )


def markdown(document: dict[str, Any]) -> str:
    points = document["points"]
    lines: list[str] = []
    for dataset, input_len, group in _groups(points):
        lines += [
            f"### {dataset}, {input_len} input tokens, {document['meta']['output_len']} output",
            "",
            "| system | load | done/err | req/s | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean "
            "| ITL P50 | ITL P99 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sorted(group, key=lambda p: (p["load_kind"], p["load"], p["system"])):
            t, tp, itl = p["ttft_ms"], p["tpot_ms"], p["itl_ms"]
            lines.append(
                f"| {p['system']} | {p['label']} | {p['completed']}/{p['errors']} "
                f"| {p['request_throughput']:.2f} | {_fmt(t['mean'])} | {_fmt(t['p50'])} "
                f"| {_fmt(t['p99'])} | {_fmt(tp['mean'], 2)} | {_fmt(itl['p50'], 2)} "
                f"| {_fmt(itl['p99'], 2)} |"
            )
        lines.append("")
        parts = [p for p in group if p.get("breakdown")]
        if parts:
            lines += [
                "kvpush TTFT breakdown, P50 per part (ms; from the gateway's per-request timing):",
                "",
                "| system | load | " + " | ".join(PART_NAMES) + " |",
                "|---|---|" + "---|" * len(PART_NAMES),
            ]
            for p in sorted(parts, key=lambda p: (p["load_kind"], p["load"], p["system"])):
                cells = " | ".join(_fmt(p["breakdown"][n]["p50"], 2) for n in PART_NAMES)
                lines.append(f"| {p['system']} | {p['label']} | {cells} |")
            lines.append("")
    rows = document.get("ratios") or []
    if rows:
        lines += [
            f"### Ratios: other system / {REFERENCE} (above 1: {REFERENCE} is better)",
            "",
            "| dataset | input | load | vs | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['dataset']} | {r['input_len']} | {r['label']} | {r['vs']} "
                f"| {_fmt(r['ttft_mean'], 2)} | {_fmt(r['ttft_p50'], 2)} "
                f"| {_fmt(r['ttft_p99'], 2)} | {_fmt(r['tpot_mean'], 2)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plots(document: dict[str, Any], out_dir: Path) -> list[Path]:
    written = []
    for dataset, input_len, group in _groups(document["points"]):
        p50: dict[str, list[tuple[float, float]]] = {}
        p99: dict[str, list[tuple[float, float]]] = {}
        for p in group:
            if p["load_kind"] != "qps" or p["ttft_ms"]["p50"] is None:
                continue
            p50.setdefault(p["system"], []).append((p["load"], p["ttft_ms"]["p50"]))
            p99.setdefault(p["system"], []).append((p["load"], p["ttft_ms"]["p99"]))
        if not p50:
            continue
        title = f"TTFT vs QPS: {dataset} prompts of {input_len} tokens"
        path = out_dir / f"ttft-{dataset}-{input_len}.png"
        written.append(ttft_chart(path, title, p50, p99))
    return written
