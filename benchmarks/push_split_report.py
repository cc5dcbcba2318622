"""The time-split table of ``tests/integration/measure_push_split.py`` (docs/connector.md).

``table(document)`` turns one ``--json`` run (every repeat's instants, ms from the moment both
legs were sent, on one clock) into the medians per event and mode, the push tail, and per
repeat the order of P's bus event (KvPushed / KvReady) against P's finished output.
``report`` prints it or writes/checks docs/connector.md's ``push-split`` section (``docgen``).

Threading model: plain functions, no state.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen

EVENTS = {  # mode -> (event key, row label) in path order
    "push": (
        ("announced", "D's announcement on the bus"),
        ("prefill_finished", "P's prefill output finished"),
        ("bus_event", "KvPushed on the bus"),
        ("first_token", "D's first token (TTFT)"),
    ),
    "pull": (
        ("prefill_finished", "P's prefill output finished"),
        ("bus_event", "KvReady on the bus"),
        ("first_token", "D's first token (TTFT)"),
    ),
    "aggregated": (("first_token", "D's first token (TTFT)"),),
}
SECTION = "push-split"
REPORT_COMMAND = (
    "python -m tests.integration.measure_push_split --report docs/benchmarks/push-split.json "
    "--doc docs/connector.md"
)


def table(document: dict[str, Any]) -> str:
    """Medians (ms from both legs sent) per event and mode; the push tail; and how often P's
    bus event came before P's finished output in the same repeat."""
    runs = document["repeats"]

    def median(mode: str, key: str) -> str:
        values = [r["events_ms"][key] for r in runs if r["mode"] == mode and key in r["events_ms"]]
        return f"{statistics.median(values):.1f}" if values else "-"

    labels = {label: key for events in EVENTS.values() for key, label in events}
    rows = [
        [label, *(median(mode, key) if (key, label) in EVENTS[mode] else "-" for mode in EVENTS)]
        for label, key in labels.items()
    ]
    tails = [r["last_layer_write_ms"] for r in runs if r.get("last_layer_write_ms") is not None]
    tail = f"{statistics.median(tails):.2f}" if tails else "-"
    rows.append(["last layer's WRITE (posted -> done)", tail, "-", "-"])
    order = []
    for mode in ("push", "pull"):
        diffs = [
            r["events_ms"]["bus_event"] - r["events_ms"]["prefill_finished"]
            for r in runs
            if r["mode"] == mode
        ]
        if diffs:
            order.append(
                [
                    mode,
                    len(diffs),
                    sum(d < 0 for d in diffs),
                    f"{statistics.median(diffs):.1f}",
                    f"{min(diffs):.1f}",
                    f"{max(diffs):.1f}",
                ]
            )
    meta = document["meta"]
    caption = (
        f"Bench model, {meta['tokens']}-token prompts, {meta['repeats']} repeats per mode "
        f"({meta['date']}, commit {meta['kvpush_rev']}); ms from the moment both legs were sent, "
        "median over the repeats ([data](benchmarks/push-split.json)):"
    )
    events = docgen.table(["event", "push", "pull", "aggregated (one engine)"], rows)
    headers = ["mode", "repeats", "event first", "median difference", "min", "max"]
    return "\n".join(
        [
            caption,
            "",
            events,
            "",
            "Per repeat, P's bus event against P's finished output (ms, event - output):",
            "",
            docgen.table(headers, order),
        ]
    )


def report(path: Path, doc: str | None, check: bool) -> int:
    body = table(json.loads(path.read_text()))
    return docgen.publish(body, doc, SECTION, REPORT_COMMAND, check)
