"""The targets of a GPU serving run with every engine on its users' default flags (issue 29).

A run whose systems include ``vllm-serve`` (``vllm serve`` on its defaults: the aggregated
baseline every user already has) is judged by these, from the medians over the repeats, every
point of each scope listed (``summary.Verdict``); ratios are kvpush-push against the peer:

- E1: TPOT mean <= 1.10x vllm-serve, every point.
- E2: TTFT P50 <= 1.05x vllm-serve at concurrency 1.
- E3: TTFT P99 <= 1.5x vllm-serve at c=1 and every rate up to vllm-serve's knee (the most
  requests per second it completed at any rate of the table: a rate past it only queues).
- E4: output throughput >= 0.9x vllm-serve at saturation (the rates past the knee; without
  one, the table's highest rate).
- E5, E6: P99 TTFT of vllm-pull-tuned and of vllm-push (vLLM's P/D as shipped) >= 1.5x
  kvpush-push's, every point; E7, E8: TPOT no worse than theirs (<= 1.00x), every point.
- E9: start to ready, cold (a system's slowest start of the run: the first on a host) <= 1.5x
  vllm-serve's; E10: a restart on the same host (its fastest start, once it started twice; or
  ``--restart``: each run's ``restart_s``) <= 60 s. Both judge every kvpush system of the run
  (a point each; E10 those that started again).
- G5 (issue 16's budget, still standing): kvpush's own time in the TTFT at c=1 <= 3 ms; G6:
  token identity with vllm-serve (``summary_gpu``).

A point meets a ratio target only when both systems' transfer checks passed and neither had
errors (``summary.verdicts``' rules).

Threading model: pure functions over immutable inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.benchmarks.serve import summary_gpu
from kvpush.benchmarks.serve.results import Document
from kvpush.benchmarks.serve.summary import (
    REFERENCE,
    Row,
    Target,
    Verdict,
    VerdictPoint,
    _median,
    _ratio,
    judge,
)
from kvpush.benchmarks.serve.summary import (
    verdicts as ratio_verdicts,
)

BASELINE = "vllm-serve"
WARM_START_S = 60.0
COLD_START_RATIO = 1.5


@dataclass(frozen=True)
class FloorTarget(Target):
    """A figure where more is better (throughput): ours / other >= ``threshold``."""

    @property
    def ratio_text(self) -> str:
        return f"{self.figure} {REFERENCE} / {self.other}"

    def value(self, ours: Row, other: Row) -> float | None:
        return _ratio(_median(ours, self.figure), _median(other, self.figure))

    def met_by(self, value: float) -> bool:
        return value >= self.threshold


def knees(all_rows: list[Row]) -> dict[tuple[str, int], float]:
    """Per table: the most requests per second vllm-serve completed at a rate."""
    found: dict[tuple[str, int], float] = {}
    for row in all_rows:
        if row.system == BASELINE and row.load_kind == "qps":
            req_s = _median(row, "req_s")
            if req_s is not None:
                found[row.table] = max(found.get(row.table, 0.0), req_s)
    return found


def targets(all_rows: list[Row]) -> tuple[Target, ...]:
    knee = knees(all_rows)
    top = {}  # per table: the highest rate measured
    for row in all_rows:
        if row.load_kind == "qps":
            top[row.table] = max(top.get(row.table, 0.0), row.load)

    def c1(row: Row) -> bool:
        return row.load_kind == "concurrency" and row.load <= 1

    def up_to_knee(row: Row) -> bool:
        return c1(row) or (row.load_kind == "qps" and row.load <= knee.get(row.table, 0.0))

    rates = {(row.table, row.load) for row in all_rows if row.load_kind == "qps"}
    past_knee = {table for table, load in rates if load > knee.get(table, 0.0)}

    def saturated(row: Row) -> bool:
        if row.load_kind != "qps":
            return False
        if row.table in past_knee:
            return row.load > knee.get(row.table, 0.0)
        return row.load == top.get(row.table)

    def every(row: Row) -> bool:
        return True

    return (
        Target("E1", "TPOT mean <= 1.10x vllm-serve", "every point", BASELINE, "tpot_mean",
               1.10, True, every),
        Target("E2", "TTFT P50 <= 1.05x vllm-serve at c=1", "c=1", BASELINE, "ttft_p50", 1.05,
               True, c1),
        Target("E3", "TTFT P99 <= 1.5x vllm-serve up to its knee",
               "c=1 and rates up to vllm-serve's most completed req/s", BASELINE, "ttft_p99",
               1.5, True, up_to_knee),
        FloorTarget("E4", "output throughput >= 0.9x vllm-serve at saturation",
                    "rates past vllm-serve's knee (else the highest)", BASELINE, "out_tok_s",
                    0.9, False, saturated),
        Target("E5", "P99 TTFT vs vllm-pull-tuned >= 1.5x", "every point", "vllm-pull-tuned",
               "ttft_p99", 1.5, False, every),
        Target("E6", "P99 TTFT vs vllm-push >= 1.5x", "every point", "vllm-push", "ttft_p99",
               1.5, False, every),
        Target("E7", "TPOT no worse than vllm-pull-tuned", "every point", "vllm-pull-tuned",
               "tpot_mean", 1.0, True, every),
        Target("E8", "TPOT no worse than vllm-push", "every point", "vllm-push", "tpot_mean",
               1.0, True, every),
    )  # fmt: skip


def start_times(document: Document) -> dict[str, list[float]]:
    """Each system's start-to-ready seconds, one per start (system and repeat)."""
    starts: dict[tuple[str, int], float] = {}
    for p in document.points:
        if p.start_s is not None:
            starts[(p.system, p.repeat)] = p.start_s
    found: dict[str, list[float]] = {}
    for (system, _), seconds in sorted(starts.items()):
        found.setdefault(system, []).append(seconds)
    return found


def _start_point(value: float | None, met: bool, label: str, why: str = "") -> VerdictPoint:
    return VerdictPoint(
        dataset="start",
        input_len=0,
        point=label,
        label=label,
        capacity_fraction=None,
        value=value,
        met=met,
        why=why,
    )


def restart_times(document: Document, name: str) -> list[float]:
    """``name``'s starts on a host it started on before: ``--restart``'s and later repeats'."""
    runs = (document.systems.get(name) or {}).get("runs") or []
    restarts = [r["restart_s"] for r in runs if r.get("restart_s")]  # --restart
    return [*restarts, *start_times(document).get(name, [])[1:]]


def start_rows(document: Document) -> list[tuple[str, float, float | None]]:
    """Per system: its slowest start (cold, the first on a host) and its fastest restart."""
    rows = []
    for name, seconds in start_times(document).items():
        warm = restart_times(document, name)
        rows.append((name, max(seconds), min(warm) if warm else None))
    return rows


def kvpush_systems(times: dict[str, list[float]]) -> list[str]:
    """The kvpush systems of a run that E9 and E10 judge (push first; no eager rows)."""
    found = [n for n in times if n.startswith("kvpush-") and not n.endswith("-eager")]
    return sorted(found, key=lambda n: (n != REFERENCE, n))


def starts(document: Document) -> list[Verdict]:
    """E9 (cold start vs vllm-serve's) and E10 (a restart on the same host), one point for each
    kvpush system of the run (push and pull start the same engines: each start counts)."""
    times = start_times(document)
    base = times.get(BASELINE)
    cold, warm = [], []
    for name in kvpush_systems(times):
        ours = times[name]
        if base:
            ratio = round(max(ours) / max(base), 3)
            cold.append(_start_point(ratio, ratio <= COLD_START_RATIO, f"{name} cold"))
        warm_starts = restart_times(document, name)
        if warm_starts:
            fastest = min(warm_starts)
            warm.append(_start_point(fastest, fastest <= WARM_START_S, f"{name} restart"))
    cold = cold or [_start_point(None, False, "cold", "no data")]
    warm = warm or [_start_point(None, False, "restart", "no data")]
    return [
        judge("E9", f"cold start <= {COLD_START_RATIO:g}x vllm-serve's", "the slowest start",
              f"start s kvpush / {BASELINE}", cold),
        judge("E10", f"restart on the same host <= {WARM_START_S:g} s", "the fastest start",
              "start s of kvpush", warm),
    ]  # fmt: skip


def applies(document: Document) -> bool:
    """Judged by these targets: a GPU run with ``vllm-serve`` among its systems."""
    return any(p.system == BASELINE for p in document.points)


def verdicts(document: Document, all_rows: list[Row]) -> list[Verdict]:
    main, others = summary_gpu.identity(document, BASELINE)
    return [
        *ratio_verdicts(all_rows, targets(all_rows)),
        *starts(document),
        summary_gpu.overhead(all_rows),
        main,
        *others,
    ]


def verdicts_of(document: Document, all_rows: list[Row]) -> list[Verdict]:
    """The targets of any document: a GPU run with every engine on its default flags (it has
    ``vllm-serve``) these, an earlier GPU run ``summary_gpu``'s, a CPU run ``summary``'s."""
    if applies(document):
        return verdicts(document, all_rows)
    if document.meta.get("device") == "cuda":
        return summary_gpu.verdicts(document, all_rows)
    return ratio_verdicts(all_rows)
