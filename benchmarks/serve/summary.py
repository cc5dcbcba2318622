"""What the tables of ``kvpush bench report`` say, computed from a results document's points.

- ``rows``: one ``Row`` per (table, point, system) over the repeats: each figure as the median
  and min-max (``Spread``), errors summed, the transfer checks merged (failed when any repeat
  failed), kvpush's TTFT breakdown as the median over repeats of each part's P50.
- ``ratios``: other system / ``REFERENCE`` (kvpush-push) of the medians, per point: above 1
  means kvpush-push is that many times better.
- ``verdicts``: the targets of the issue, each met or missed from the medians, with every point
  of its scope listed. A point meets a target only when both systems' transfer checks passed;
  a target is met only when every point of its scope meets it (a point without data, or with
  a failed check, is a miss), and "not measured" when its scope has no point with data.

Threading model: pure functions over immutable inputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvpush.benchmarks.serve import ALL_SYSTEMS
from kvpush.benchmarks.serve.results import Document, Point, ring_partial
from kvpush.services.telemetry.breakdown import PART_NAMES

REFERENCE = "kvpush-push"
FIGURES: dict[str, Callable[[Point], float | None]] = {
    "ttft_mean": lambda p: p.ttft_ms.mean,
    "ttft_p50": lambda p: p.ttft_ms.p50,
    "ttft_p99": lambda p: p.ttft_ms.p99,
    "tpot_mean": lambda p: p.tpot_ms.mean,
    "itl_p50": lambda p: p.itl_ms.p50,
    "req_s": lambda p: p.request_throughput,
    "out_tok_s": lambda p: p.output_throughput,
}
RATIO_FIGURES = ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean")


class Spread(msgspec.Struct, frozen=True):
    median: float
    lo: float
    hi: float
    n: int


class CheckSummary(msgspec.Struct, kw_only=True):
    applies: bool
    ok: bool
    checked: int = 0
    without_transfer: int = 0
    failed_repeats: list[int] = msgspec.field(default_factory=list)  # 1-based
    unchecked_repeats: list[int] = msgspec.field(default_factory=list)  # no check recorded
    details: list[str] = msgspec.field(default_factory=list)


class Row(msgspec.Struct, kw_only=True):
    system: str
    dataset: str
    input_len: int
    point: str
    label: str
    load_kind: str
    load: float
    capacity_fraction: float | None
    runs: int
    requests: int
    completed: int
    errors: int
    figures: dict[str, Spread]
    check: CheckSummary
    breakdown: dict[str, float] | None = None  # part -> median over repeats of its P50
    breakdown_partial: str = ""  # repeats whose parts are of the ring's last rows: "200 of 480"
    first_token_by: str = ""  # "prefill": P sampled the first token (see results.Point)

    @property
    def table(self) -> tuple[str, int]:
        return self.dataset, self.input_len


def spread(values: list[float | None]) -> Spread | None:
    found = [float(v) for v in values if v is not None]
    if not found:
        return None
    return Spread(statistics.median(found), min(found), max(found), len(found))


def _check(points: list[Point]) -> CheckSummary:
    checks = [(p.repeat + 1, p.transfer_check) for p in points]
    if all(c is not None and not c.applies for _, c in checks):
        return CheckSummary(applies=False, ok=True)
    summary = CheckSummary(applies=True, ok=True)
    for repeat, c in checks:
        if c is None:
            summary.unchecked_repeats.append(repeat)
            continue
        summary.checked += c.checked
        summary.without_transfer += c.without_transfer
        if not c.ok:
            summary.failed_repeats.append(repeat)
            summary.details.append(f"r{repeat}: {c.detail}")
    summary.ok = not summary.failed_repeats and not summary.unchecked_repeats
    return summary


def _breakdown(points: list[Point]) -> dict[str, float] | None:
    found = [p.breakdown for p in points if p.breakdown]
    if not found:
        return None
    parts = {}
    for name in PART_NAMES:
        median = spread([(b.get(name) or {}).get("p50") for b in found])
        if median is not None:
            parts[name] = round(median.median, 3)
    return parts


def _order(row: Row | Point) -> tuple[int, float]:
    return (0 if row.load_kind == "concurrency" else 1), row.load


def tables(document: Document) -> list[tuple[str, int]]:
    """The (dataset, input length) tables in the run's order (the plan's, else sorted)."""
    found = {(p.dataset, p.input_len) for p in document.points}
    planned = []
    for key in document.meta.get("tables") or []:
        dataset, _, length = str(key).partition(":")
        if (dataset, int(length or 0)) in found:
            planned.append((dataset, int(length)))
    return planned + sorted(found - set(planned))


def system_order(name: str) -> int:
    return ALL_SYSTEMS.index(name) if name in ALL_SYSTEMS else len(ALL_SYSTEMS)


def rows(document: Document) -> list[Row]:
    """One row per (table, point, system), tables in run order, points by load."""
    groups: dict[tuple[str, int, str, str], list[Point]] = {}
    for p in document.points:
        groups.setdefault((p.dataset, p.input_len, p.point, p.system), []).append(p)
    order = {t: i for i, t in enumerate(tables(document))}
    found = []
    for (dataset, input_len, point_id, system), points in groups.items():
        points.sort(key=lambda p: p.repeat)
        first = points[0]
        figures = {}
        for name, read in FIGURES.items():
            value = spread([read(p) for p in points])
            if value is not None:
                figures[name] = value
        found.append(
            Row(
                system=system,
                dataset=dataset,
                input_len=input_len,
                point=point_id,
                label=first.label,
                load_kind=first.load_kind,
                load=first.load,
                capacity_fraction=first.capacity_fraction,
                runs=len(points),
                requests=sum(p.requests for p in points),
                completed=sum(p.completed for p in points),
                errors=sum(p.errors for p in points),
                figures=figures,
                check=_check(points),
                breakdown=_breakdown(points),
                breakdown_partial=", ".join(
                    shown for p in points if (shown := ring_partial(p.breakdown))
                ),
                first_token_by=first.first_token_by,
            )
        )
    found.sort(key=lambda r: (order[r.table], *_order(r), system_order(r.system)))
    return found


def _median(row: Row | None, figure: str) -> float | None:
    if row is None or figure not in row.figures:
        return None
    return row.figures[figure].median


def _ratio(other: float | None, ours: float | None) -> float | None:
    if other is None or ours is None or ours <= 0:
        return None
    return round(other / ours, 3)


class Ratio(msgspec.Struct, kw_only=True):
    dataset: str
    input_len: int
    point: str
    label: str
    capacity_fraction: float | None
    vs: str
    values: dict[str, float | None]  # figure -> other median / kvpush-push median
    checks_ok: bool  # both systems' transfer checks passed at this point


def ratios(all_rows: list[Row]) -> list[Ratio]:
    ours = {(r.table, r.point): r for r in all_rows if r.system == REFERENCE}
    found = []
    for r in all_rows:
        mine = ours.get((r.table, r.point))
        if r.system == REFERENCE or mine is None:
            continue
        values = {f: _ratio(_median(r, f), _median(mine, f)) for f in RATIO_FIGURES}
        found.append(
            Ratio(
                dataset=r.dataset,
                input_len=r.input_len,
                point=r.point,
                label=r.label,
                capacity_fraction=r.capacity_fraction,
                vs=r.system,
                values=values,
                checks_ok=r.check.ok and mine.check.ok,
            )
        )
    return found


@dataclass(frozen=True)
class Target:
    """One target: ``value`` = other / ours (``at_least``) or ours / other (``at_most``)."""

    key: str
    text: str
    scope: str
    other: str
    figure: str
    threshold: float
    at_most: bool
    applies: Callable[[Row], bool]

    @property
    def ratio_text(self) -> str:
        what = {"ttft_p99": "TTFT P99", "ttft_mean": "TTFT mean", "ttft_p50": "TTFT P50"}
        name = what.get(self.figure, self.figure)
        if self.at_most:
            return f"{name} {REFERENCE} / {self.other}"
        return f"{name} {self.other} / {REFERENCE}"

    def value(self, ours: Row, other: Row) -> float | None:
        if self.at_most:
            return _ratio(_median(ours, self.figure), _median(other, self.figure))
        return _ratio(_median(other, self.figure), _median(ours, self.figure))

    def met_by(self, value: float) -> bool:
        return value <= self.threshold if self.at_most else value >= self.threshold


def _high_qps(row: Row) -> bool:
    fraction = row.capacity_fraction
    return row.load_kind == "qps" and fraction is not None and fraction >= 0.75


def _low_load(row: Row) -> bool:
    if row.load_kind == "concurrency":
        return row.load <= 1
    return row.capacity_fraction is not None and row.capacity_fraction <= 0.25


TARGETS = (
    Target(
        "T1",
        "P99 TTFT vs vllm-pull >= 2.0x at high QPS, 2k prompts",
        "2048-token tables, QPS points >= 0.75x capacity",
        "vllm-pull",
        "ttft_p99",
        2.0,
        False,
        lambda r: r.input_len == 2048 and _high_qps(r),
    ),
    Target(
        "T2",
        "mean TTFT vs vllm-pull >= 1.3x",
        "every point",
        "vllm-pull",
        "ttft_mean",
        1.3,
        False,
        lambda r: True,
    ),
    Target(
        "T3",
        "mean TTFT vs vllm-push >= 1.2x",
        "every point",
        "vllm-push",
        "ttft_mean",
        1.2,
        False,
        lambda r: True,
    ),
    Target(
        "T4",
        "P50 TTFT <= 1.10x aggregated at low load",
        "c=1 and QPS points <= 0.25x capacity",
        "aggregated",
        "ttft_p50",
        1.10,
        True,
        _low_load,
    ),
)


class VerdictPoint(msgspec.Struct, kw_only=True):
    dataset: str
    input_len: int
    point: str
    label: str
    capacity_fraction: float | None
    value: float | None
    met: bool
    why: str = ""  # a miss that is not a number: "no data", "transfer check failed", "errors"


class Verdict(msgspec.Struct, kw_only=True):
    key: str
    text: str
    scope: str
    ratio: str  # what each point's value is
    verdict: str  # met | missed | not measured
    points: list[VerdictPoint]

    @property
    def met_count(self) -> int:
        return sum(1 for p in self.points if p.met)


def verdicts(all_rows: list[Row], targets: tuple[Target, ...] = TARGETS) -> list[Verdict]:
    by_key = {(r.table, r.point, r.system): r for r in all_rows}
    found = []
    for target in targets:
        points = []
        for ours in all_rows:
            if ours.system != REFERENCE or not target.applies(ours):
                continue
            other = by_key.get((ours.table, ours.point, target.other))
            value = None if other is None else target.value(ours, other)
            why = ""
            if value is None or other is None:
                why = "no data"
            elif ours.check.failed_repeats or other.check.failed_repeats:
                why = "transfer check failed"
            elif not (ours.check.ok and other.check.ok):
                why = "transfer not checked"
            elif ours.errors or other.errors:  # a figure of the survivors is no measure
                why = "errors"
            met = not why and value is not None and target.met_by(value)
            points.append(verdict_point(ours, value, met, why))
        found.append(judge(target.key, target.text, target.scope, target.ratio_text, points))
    return found


def verdict_point(row: Row | Point, value: float | None, met: bool, why: str = "") -> VerdictPoint:
    return VerdictPoint(
        dataset=row.dataset,
        input_len=row.input_len,
        point=row.point,
        label=row.label,
        capacity_fraction=row.capacity_fraction,
        value=value,
        met=met,
        why=why,
    )


def judge(key: str, text: str, scope: str, ratio: str, points: list[VerdictPoint]) -> Verdict:
    """Met when every point of the scope met it; not measured when none had data."""
    if all(p.why == "no data" for p in points):  # also: no point in scope
        verdict = "not measured"
    else:
        verdict = "met" if all(p.met for p in points) else "missed"
    return Verdict(key=key, text=text, scope=scope, ratio=ratio, verdict=verdict, points=points)
