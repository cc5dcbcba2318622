"""Tables of ``kvpush bench transport``: one run's table, and the summary of several runs.

``table(cases)`` is what one run prints. ``summary(runs)`` turns several runs' JSON documents
(``kvpush bench transport --json``) into the committed tables of docs/benchmarks/transport.md:
per case the median over runs of every column, the spread (min-max over runs) of the ratios
push and pull reach against raw NIXL, and one line per run. ``kvpush bench transport --report
DIR --doc FILE [--check]`` writes (or checks) that section (``docgen``).

Threading model: plain functions, no state.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.benchmarks import docgen

COLUMNS = (  # (header, format of one case)
    ("tokens", "{tokens}"),
    ("KV MiB", "{mib:.0f}"),
    ("push GB/s (ms)", "{push_GBps:.2f} ({push_ms:.2f})"),
    ("start_push ms", "{push_start_ms:.2f}"),
    ("last-layer tail ms", "{push_tail_ms:.2f}"),
    ("push 1-req GB/s (ms)", "{push_1req_GBps:.2f} ({push_1req_ms:.2f})"),
    ("push frag GB/s (descs)", "{push_frag_GBps:.2f} ({frag_descriptors})"),
    ("pull GB/s (ms)", "{pull_GBps:.2f} ({pull_ms:.2f})"),
    ("raw WRITE GB/s (ms)", "{raw_GBps:.2f} ({raw_ms:.2f})"),
    ("raw WRITE/layer GB/s", "{raw_layered_GBps:.2f}"),
    ("raw READ GB/s", "{raw_read_GBps:.2f}"),
    ("memcpy GB/s (ms)", "{memcpy_GBps:.2f} ({memcpy_ms:.2f})"),
    ("push/raw", "{push_vs_raw:.2f}"),
    ("notice ms", "{notify_ms:.3f}"),
)
RATIOS = (  # (header, numerator, denominator): GB/s against GB/s
    ("push / raw WRITE", "push_GBps", "raw_GBps"),
    ("push 1-req / raw WRITE", "push_1req_GBps", "raw_GBps"),
    ("push / raw WRITE per layer", "push_GBps", "raw_layered_GBps"),
    ("pull / raw READ", "pull_GBps", "raw_read_GBps"),
    ("pull / raw WRITE", "pull_GBps", "raw_GBps"),
)
STREAM_COLUMNS = (  # the streamed push (cases of runs that measured it)
    ("tokens", "{tokens}"),
    ("layer compute ms", "{layer_ms:g}"),
    ("forward thread us per layer", "{stream_forward_us:.1f}"),
    ("last layer's post us", "{post}"),
    ("last layer -> P's DONE us", "{stream_p_tail_us:.0f}"),
    ("last layer -> D saw DONE us", "{stream_d_tail_us:.0f}"),
    ("poll busy/target us: P, D", "{poll}"),
)
REPORT_COMMAND = (
    "kvpush bench transport --report docs/benchmarks/transport --doc docs/benchmarks/transport.md"
)


def table(cases: Sequence[dict[str, Any]]) -> str:
    """One run's cases, every column."""
    rows = []
    for case in cases:
        values = {**case, "mib": case["kv_bytes"] / 2**20}
        rows.append([f.format(**values) for _, f in COLUMNS])
    return docgen.table([h for h, _ in COLUMNS], rows)


def stream_table(cases: Sequence[dict[str, Any]]) -> str:
    """The streamed push of each case ("" when the cases did not measure it)."""
    if not cases or any("stream_d_tail_us" not in c for c in cases):
        return ""
    rows = []
    for case in cases:
        us = [f"{x:g}" for x in case.get("poll_us", ())]
        poll = ", ".join("/".join(us[i : i + 2]) for i in range(0, len(us), 2)) or "-"
        post = f"{case['stream_post_us']:.0f}" if "stream_post_us" in case else "-"
        rows.append([f.format(**{**case, "poll": poll, "post": post}) for _, f in STREAM_COLUMNS])
    return docgen.table([h for h, _ in STREAM_COLUMNS], rows)


SETTINGS = ("device", "error_mode", "descriptors", "repeats")  # what runs must share
SETTING_DEFAULTS = {"device": "cpu"}  # what runs from before a setting existed ran with


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """Every ``run-*.json`` of ``folder``, in name order; they must be runs of the same cases
    with the same settings (else ``ValueError``: a summary over them would mix two things)."""
    runs = [json.loads(path.read_text()) for path in sorted(folder.glob("run-*.json"))]
    if not runs:
        raise FileNotFoundError(f"no run-*.json in {folder}")
    shapes = {
        tuple(
            (c["tokens"], *(c.get(k, SETTING_DEFAULTS.get(k)) for k in SETTINGS))
            for c in run["cases"]
        )
        for run in runs
    }
    if len(shapes) > 1:
        raise ValueError(f"{folder}: the runs differ in cases or settings {SETTINGS}: {shapes}")
    return runs


def _by_tokens(runs: Sequence[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        for case in run["cases"]:
            found.setdefault(int(case["tokens"]), []).append(case)
    return dict(sorted(found.items()))


def _median_case(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = dict(cases[0])
    for key, value in cases[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(float(c[key]) for c in cases)
    merged["frag_descriptors"] = int(merged["frag_descriptors"])
    merged["tokens"] = int(merged["tokens"])
    return merged


def summary(runs: Sequence[dict[str, Any]]) -> str:
    """The committed section: medians over runs, ratio spreads, and the runs themselves."""
    grouped = _by_tokens(runs)
    median_cases = [_median_case(cases) for cases in grouped.values()]
    medians = table(median_cases)
    streamed = stream_table(median_cases)
    if streamed:
        medians += (
            "\n\nThe streamed push (layers pushed as computed, both sides polled as a "
            "worker polls):\n\n" + streamed
        )
    ratio_rows = []
    for tokens, cases in grouped.items():
        row = [str(tokens)]
        for _, num, den in RATIOS:
            values = [c[num] / c[den] for c in cases]
            row.append(f"{min(values):.3f}-{max(values):.3f}")
        ratio_rows.append(row)
    ratios = docgen.table(["tokens", *(h for h, _, _ in RATIOS)], ratio_rows)
    run_rows = []
    for i, run in enumerate(runs, 1):
        meta = run.get("meta", {})
        push_vs_raw = ", ".join(f"{c['push_vs_raw']:.3f}" for c in run["cases"])
        run_rows.append(
            [
                str(i),
                str(meta.get("date", "-")),
                str(meta.get("kvpush_rev", "-")),
                str(meta.get("repeats", run["cases"][0].get("repeats", "-"))),
                str(meta.get("elapsed_s", "-")),
                f"{meta['load_avg']:.2f}" if "load_avg" in meta else "-",
                push_vs_raw,
            ]
        )
    headers = ["run", "date", "rev", "repeats", "seconds", "load", "push/raw per case"]
    listing = docgen.table(headers, run_rows)
    return (
        f"Median over {len(runs)} runs (each cell: the median of the runs' medians):\n\n"
        f"{medians}\n\nRatios, min-max over the {len(runs)} runs:\n\n{ratios}\n\n"
        f"The runs ([data](transport/)):\n\n{listing}"
    )


GPU_REPORT_COMMAND = (
    "kvpush bench transport --report docs/benchmarks/gpu-transport --doc docs/benchmarks/gpu.md"
)


def gpu_summary(folder: Path) -> str:
    """GPU runs (``--device cuda``, ``*.json`` in name order): each full run's table and its
    streamed push, then every streamed-only run's (settings in its columns) in one table."""
    runs = [(p.name, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    if not runs:
        raise FileNotFoundError(f"no *.json in {folder}")
    parts, streamed = [], []
    for name, run in runs:
        meta = run.get("meta", {})
        stamp = f"{meta.get('date', '-')}, {meta.get('kvpush_rev', '-')}"
        cases = run["cases"]
        if "push_GBps" not in cases[0]:  # --stream-only
            streamed += cases
            continue
        parts.append(
            f"Every case, median of {cases[0]['repeats']} ([{name}](gpu-transport/{name}), "
            f"{stamp}):\n\n{table(cases)}\n\nIts streamed push:\n\n{stream_table(cases)}"
        )
    if streamed:
        idle = ", ".join(f"{c['idle_poll_us']:g}" for c in streamed if "idle_poll_us" in c)
        parts.append(
            "The streamed push alone under other poll intervals (one row per run and case; "
            f"an idle `poll()` of P's transport took {idle} us in these runs):\n\n"
            + stream_table(streamed)
        )
    return "\n\n".join(parts)


def report(folder: Path, doc: str | None, check: bool) -> int:
    """``--report``: print the summary of ``folder``'s runs, or write/check it in ``doc`` (GPU
    runs: ``gpu_summary`` into the section ``gpu-transport``)."""
    if any(
        json.loads(p.read_text())["cases"][0].get("device") == "cuda"
        for p in sorted(folder.glob("*.json"))[:1]
    ):
        body = gpu_summary(folder)
        return docgen.publish(body, doc, "gpu-transport", GPU_REPORT_COMMAND, check)
    return docgen.publish(summary(load_runs(folder)), doc, "transport", REPORT_COMMAND, check)
