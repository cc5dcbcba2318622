"""The TTFT report of a set of spans: per-request breakdowns, their summary and its text form.

Owns ``Report`` (the complete requests and the skipped traces), ``Stats`` (mean, p50, p99),
``percentile``, the table and summary text the ``kvpush ttft`` command prints, and ``UsageError``
(the one-line problems both ``ttft`` and ``ttft_listen`` report with exit status 2). The
breakdown itself is ``breakdown``'s.

Threading model: plain functions and values. Only the standard library is imported at module
level (``kvpush --help`` stays instant).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from kvpush.schemas.spans import SpanRecord
    from kvpush.services.telemetry.breakdown import Breakdown

# Human labels of breakdown.PART_NAMES, same order.
PART_LABELS: Final = (
    "gateway",
    "queue at P",
    "prefill compute",
    "push tail",
    "D wait",
    "D first step",
    "streaming",
)
WIDTHS: Final = (14, 5, 8, *(max(len(label), 7) for label in PART_LABELS))  # the table's columns
PERCENTILES: Final = "linear interpolation between closest ranks (numpy's default)"


class UsageError(Exception):
    """A problem with the arguments or the input, told in one line (exit status 2)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear between closest ranks; NaN if
    empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclasses.dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        mean = sum(values) / len(values) if values else math.nan
        return cls(mean, percentile(values, 50), percentile(values, 99))

    def as_dict(self) -> dict[str, float | None]:
        return {
            k: None if math.isnan(v) else round(v, 3) for k, v in dataclasses.asdict(self).items()
        }


@dataclasses.dataclass(frozen=True)
class Report:
    """The complete requests of a set of spans, and how many traces were skipped."""

    breakdowns: list[Breakdown]
    traces: int
    no_root: int  # traces without a gateway.request span
    no_first_byte: int  # with a root but no (usable) first byte

    def ttft(self) -> Stats:
        return Stats.of([b.ttft_ms for b in self.breakdowns])

    def parts(self) -> list[Stats]:
        return [Stats.of([b.parts_ms[i] for b in self.breakdowns]) for i in range(len(PART_LABELS))]

    def as_dict(self) -> dict[str, Any]:
        from kvpush.services.telemetry.breakdown import PART_NAMES

        return {
            "parts": dict(zip(PART_NAMES, PART_LABELS, strict=True)),
            "percentiles": PERCENTILES,
            "requests": [b.as_dict() for b in self.breakdowns],
            "summary": {
                "count": len(self.breakdowns),
                "traces": self.traces,
                "skipped_no_root": self.no_root,
                "skipped_no_first_byte": self.no_first_byte,
                "ttft_ms": self.ttft().as_dict(),
                "parts_ms": {n: s.as_dict() for n, s in zip(PART_NAMES, self.parts(), strict=True)},
            },
        }


def analyze(spans: Iterable[SpanRecord]) -> Report:
    from kvpush.services.telemetry.breakdown import breakdowns_from_spans

    spans = list(spans)
    traces = {s.trace_id for s in spans}
    rooted = {s.trace_id for s in spans if s.name == "gateway.request"}
    found = breakdowns_from_spans(spans)
    return Report(found, len(traces), len(traces - rooted), len(rooted) - len(found))


def short_id(b: Breakdown) -> str:
    """The request id (or trace id), cut to its last 12 characters when longer than 14."""
    text = b.request_id or b.trace_id
    return text if len(text) <= 14 else f"..{text[-12:]}"


def _line(cells: Sequence[str]) -> str:
    """A table line: the request and mode left-aligned, the numbers right-aligned."""
    return "  ".join(
        c.ljust(w) if i < 2 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, WIDTHS, strict=True))
    )


def table_header() -> str:
    return (
        _line(["request", "mode", "TTFT", *PART_LABELS]) + "\n" + _line(["-" * w for w in WIDTHS])
    )


def table_row(b: Breakdown) -> str:
    return _line([short_id(b), b.mode or "-", *(f"{v:.2f}" for v in (b.ttft_ms, *b.parts_ms))])


def format_summary(report: Report, shown: int) -> str:
    count = len(report.breakdowns)
    lines = [
        f"{count} complete request{'s' if count != 1 else ''}"
        + (f" (rows: the last {shown})" if shown < count else "")
    ]
    skipped = report.no_root + report.no_first_byte
    if skipped:
        lines[0] += (
            f"; skipped {skipped} trace{'s' if skipped != 1 else ''}: "
            f"{report.no_root} without a gateway.request root, "
            f"{report.no_first_byte} without a first byte"
        )
    if not count:
        return lines[0]
    ttft = report.ttft()
    lines.append(f"p50/p99: {PERCENTILES}; share: of the mean TTFT")
    lines.append(f"{'ms':<17}{'mean':>9}{'p50':>9}{'p99':>9}{'share':>8}")
    lines.append(f"{'TTFT':<17}{ttft.mean:>9.2f}{ttft.p50:>9.2f}{ttft.p99:>9.2f}{'100%':>8}")
    for label, stats in zip(PART_LABELS, report.parts(), strict=True):
        share = f"{100 * stats.mean / ttft.mean:.0f}%" if ttft.mean > 0 else "-"
        lines.append(f"  {label:<15}{stats.mean:>9.2f}{stats.p50:>9.2f}{stats.p99:>9.2f}{share:>8}")
    return "\n".join(lines)
