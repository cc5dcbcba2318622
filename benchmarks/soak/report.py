"""The soak's report: one typed document (written as JSON), its verdict, and its markdown.

``SoakReport`` is what ``kvpush bench soak --json OUT`` writes; ``load`` reads it back.
``failures`` is the verdict: the run fails on any wrong token (a 200 or an aborted stream's
prefix whose ids differ from the reference), any unexpected answer (an error the running fault
does not explain, a non-OpenAI body, a reset, a timeout), any leaked block or worker that never
went idle, a success share below ``--min-success-share``, no fault injected (or a kind of
fault missing from a whole round; with the killer's schedule, a nats-server restarted other
than once), a killed or stopped worker the gateway never counted gone or counted gone later
than ``detect_target_s`` (``measure.detection_failures``), no request checked with KV received
from the prefill worker in push and in pull mode (a soak of local answers proves nothing about
KV), the gateway's own kv outcome counts disagreeing with the soak's checked paths, or a load
phase that stopped early (a worker or nats-server that failed on its own).

``markdown`` renders the tables of a report, deterministically, so the copy in
``docs/reliability.md`` (its generated section: ``SECTION`` for the CPU soak, one per GPU run
from ``GPU_SECTION`` on, by the report's device and file: ``section_of``; see
``kvpush.benchmarks.docgen``) can
be checked against the committed JSON. Reports written before the killer (one worker per
role, every kind in rounds), or before the device and model were recorded (the CPU soak, the
tiny model), load with the defaults of the fields they lack and render as they did.

Threading model: none (pure functions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec

from kvpush.benchmarks.soak.accounting import (
    ErrorKind,
    Interval,
    LeakSummary,
    PathCount,
    leak_failures,
)
from kvpush.benchmarks.soak.measure import (
    DETECTION_KINDS,
    FaultRecord,
    FaultSummary,
    detection_failures,
)

SECTION: Final = "soak"
REPORT_COMMAND: Final = (
    "kvpush bench soak --report docs/reliability-soak.json --doc docs/reliability.md"
)
GPU_SECTION: Final = "soak-h200"  # a cuda run: the H200's (tests/gpu/h200.sh soak)
GPU_REPORT_COMMAND: Final = (
    "kvpush bench soak --report docs/reliability-soak-h200.json --doc docs/reliability.md"
)
TRANSFERRED: Final = ("push/received", "pull/received")
NATS: Final = "restart_nats"
ROUNDS, KILLER = "rounds", "killer"  # schedules: every kind in rounds; nats-server once
BEFORE_KILLER: Final = ("kill_prefill", "kill_decode", "stop_decode", NATS, "burst")


class SoakSettings(msgspec.Struct, frozen=True):
    minutes: float
    concurrency: int
    fault_every_s: float
    recovery_s: float
    abort_share: float
    stream_share: float
    layer_delay_ms: float
    prompts: int
    max_tokens: int
    seed: int
    gateway_max_inflight: int
    burst_clients: int
    settle_timeout_s: float
    min_success_share: float
    prefill: int = 1
    decode: int = 1
    faults: tuple[str, ...] = BEFORE_KILLER
    schedule: str = ROUNDS
    rate_window_s: float = 10.0  # the sliding window of the throughput (measure.recovery_time)
    detect_target_s: float = 2.0
    # None in reports written before these were recorded (the CPU soak, the tiny model)
    device: str | None = None  # cpu | cuda
    model: str | None = None  # --model: a recipe (tiny, llama-8b) or a folder
    prompt_tokens: int | None = None  # each prompt about this many tokens (None: 8-40 words)
    time_budget_s: float | None = None  # the whole run's (None: --minutes of load)
    start_timeout_s: float | None = None  # a worker's start
    gpu: int | None = None  # cuda: the GPU every engine shares
    gpu_memory_utilization: float | None = None  # cuda: free at each engine's start
    kv_cache_gib: float | None = None  # cuda: each engine's KV cache


class SoakReport(msgspec.Struct, frozen=True):
    settings: SoakSettings
    wall_s: float  # the whole run, stack start to stop
    load_s: float  # load and faults, quiesces included
    counts: dict[str, int]  # by checks.Category value
    sent: int
    success_share: float
    paths: list[PathCount]
    windows: dict[str, dict[str, int]]  # window -> category -> requests sent in it
    errors: list[ErrorKind]
    examples: list[str]  # the first wrong / unexpected answers
    faults: dict[str, int]
    intervals: list[Interval]
    leaks: list[LeakSummary]
    gateway_kv_outcomes: dict[str, int]  # the gateway's own counter: must agree with paths
    failures: list[str]  # empty: the run passed
    date: str = "-"  # when the run started (UTC)
    kvpush_rev: str = "-"  # the code it ran (``-dirty``: with uncommitted changes)
    stopped_early: str = ""  # why the load phase ended before its time (a failure)
    moved: int = 0  # token-exact 200s the gateway moved to other workers on the way
    fault_records: list[FaultRecord] = []  # one per fault, in order
    fault_summary: list[FaultSummary] = []  # per kind
    gpu_name: str | None = None  # cuda: the card, as nvidia-smi names it (None: before kept)

    @property
    def passed(self) -> bool:
        return not self.failures


def failures(report: SoakReport) -> list[str]:
    """The verdict of a report (without its own ``failures``); see the module docstring."""
    out = []
    counts = report.counts
    if counts.get("wrong", 0):
        out.append(f"{counts['wrong']} answer(s) with wrong tokens")
    if counts.get("unexpected", 0):
        out.append(f"{counts['unexpected']} unexpected answer(s)")
    floor = report.settings.min_success_share
    if report.success_share < floor:
        out.append(f"success share {report.success_share:.3f} below {floor:g}")
    if report.stopped_early:
        out.append(f"the run stopped early: {report.stopped_early}")
    s = report.settings
    once = s.schedule == KILLER and NATS in s.faults
    rounds = [kind for kind in s.faults if not (once and kind == NATS)]
    if not report.faults:
        out.append("no fault was injected")
    else:
        if sum(report.faults.get(k, 0) for k in rounds) >= len(rounds):  # a whole round ran
            out += [f"fault {kind} never ran" for kind in rounds if not report.faults.get(kind)]
        if once and report.faults.get(NATS, 0) != 1:
            out.append(f"nats-server restarted {report.faults.get(NATS, 0)} times, not once")
    out += detection_failures(report.fault_records, s.detect_target_s)
    checked = {p.path: p.json + p.stream for p in report.paths}
    out += [f"no {path} request was checked" for path in TRANSFERRED if not checked.get(path)]
    if not counts.get("unverified", 0):  # every 200 attributed to a path: the two must agree
        for path in sorted({*report.gateway_kv_outcomes, *(p for p in checked if "/" in p)}):
            gateway, soak = report.gateway_kv_outcomes.get(path, 0), checked.get(path, 0)
            if gateway != soak:
                out.append(f"{path}: the gateway counted {gateway}, the soak checked {soak}")
    return out + leak_failures(report.intervals)


def section_of(report: SoakReport, path: Path | None = None) -> tuple[str, str]:
    """The generated section of ``docs/reliability.md`` a report goes to, and its command. A
    GPU run (each under 10 minutes: a few faults each) has one of its own, named after its
    file: ``reliability-soak-h200-2.json`` -> ``soak-h200-2`` (the first, ``GPU_SECTION``)."""
    if report.settings.device != "cuda":
        return SECTION, REPORT_COMMAND
    if path is None or not path.stem.startswith(f"reliability-{GPU_SECTION}"):
        return GPU_SECTION, GPU_REPORT_COMMAND
    name = path.stem.removeprefix("reliability-")
    return name, f"kvpush bench soak --report docs/{path.name} --doc docs/reliability.md"


def load(path: Path) -> SoakReport:
    return msgspec.json.decode(path.read_bytes(), type=SoakReport)


def dump(report: SoakReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def _workers(counts: dict[str, int]) -> str:
    return ", ".join(f"{w} x{n}" for w, n in counts.items()) or "-"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _faults_line(s: SoakSettings) -> str:
    kinds = ", ".join(k for k in s.faults if not (s.schedule == KILLER and k == NATS))
    if s.schedule == KILLER:
        nats = "; nats-server restarted once" if NATS in s.faults else ""
        return (
            f"a fault every {s.fault_every_s:g} s ({kinds}, in rounds, each kill or stop on a "
            f"random worker of its role{nats})"
        )
    return f"a fault every {s.fault_every_s:g} s ({kinds}, in rounds)"


def _engines_line(s: SoakSettings, gpu_name: str | None = None) -> str:
    """The device, model and prompts (nothing for reports written before they were kept)."""
    if s.device is None:
        return ""
    size = f"about {s.prompt_tokens} tokens" if s.prompt_tokens else "8-40 words"
    prompts = f"prompts of {size}"
    if s.device != "cuda":
        return f" ({s.device}, model {s.model}, {prompts}, {s.max_tokens} tokens out)"
    return (
        f" (cuda: every engine on GPU {s.gpu}{f' ({gpu_name})' if gpu_name else ''}, "
        f"model {s.model}, the workers' CUDA defaults, each "
        f"engine started with {s.gpu_memory_utilization:g} of the GPU's memory free and a "
        f"{s.kv_cache_gib:g} GiB KV cache; {prompts}, {s.max_tokens} tokens out)"
    )


def _budget_line(s: SoakSettings) -> str:
    if s.time_budget_s is None:
        return ""
    return f" (the load cut to fit a time budget of {s.time_budget_s:g} s for the whole run)"


def _delay(s: SoakSettings) -> str:
    if not s.layer_delay_ms and s.device is not None:
        return "P not slowed"
    return f"P sleeping {s.layer_delay_ms:g} ms per layer"


def _cached_note(report: SoakReport) -> str:
    """The ``cached`` path explained where a report has one (prompts of a block or more)."""
    if not any(p.path.endswith("/cached") for p in report.paths):
        return ""
    return "; `cached`: D's own prefix cache held the prompt, nothing moved"


def markdown(report: SoakReport) -> str:
    s, c = report.settings, report.counts
    verdict = "**PASS**" if report.passed else "**FAIL**: " + "; ".join(report.failures)
    burst = f", bursts of {s.burst_clients} extra clients" if "burst" in s.faults else ""
    lines = [
        f"Run ({report.date}, commit {report.kvpush_rev}): {s.minutes:g} min of load and "
        f"faults{_budget_line(s)} ({report.load_s:.0f} s with the quiesces, "
        f"{report.wall_s:.0f} s in all) on {s.prefill} prefill + {s.decode} decode "
        f"workers{_engines_line(s, report.gpu_name)}, "
        f"{s.concurrency} clients, {_faults_line(s)}, {_delay(s)}, "
        f"{_share(s.stream_share)} streamed to the end, {_share(s.abort_share)} streamed "
        f"and dropped by the client, gateway in-flight bound {s.gateway_max_inflight}{burst}, "
        f"{s.recovery_s:g} s of load after each recovery, settle timeout "
        f"{s.settle_timeout_s:g} s. Verdict: {verdict}.",
        "",
        "| requests | token-exact 200s (moved on the way) | wrong tokens "
        "| unverified (ids not seen) | client aborts | expected errors | unexpected "
        "| success share (floor) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {report.sent} | {c.get('ok', 0)} ({report.moved}) | **{c.get('wrong', 0)}** "
        f"| {c.get('unverified', 0)} | {c.get('aborted', 0)} | {c.get('expected_error', 0)} "
        f"| **{c.get('unexpected', 0)}** | {_share(report.success_share)} "
        f"({_share(s.min_success_share)}) |",
        "",
        "Checked answers by the way they were made (mode the gateway routed / where the KV came "
        "from; `local`: D computed the prompt, which proves nothing about KV; `fallback`: D "
        f"recomputed it after the transfer failed{_cached_note(report)}):",
        "",
        "| path | token-exact, JSON | token-exact, streamed | client aborts, prefix exact "
        "| wrong |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.path} | {p.json} | {p.stream} | {p.aborted} | {p.wrong} |" for p in report.paths
    ]
    lines += [
        "",
        "Blocks leaked per interval (free blocks of each idle worker at its start minus at its "
        "end; a restarted worker's old blocks die with it, so for it, and for a stopped one that "
        "rejoined with a new epoch, the new incarnation is measured: every block free once idle "
        "again):",
        "",
        "| interval | times | requests sent (token-exact) | in flight at the faults "
        "| workers measured across it | leaked (sum / max) | new epoch (restarted, rejoined) "
        "| new incarnation leaked (sum / max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for leak in report.leaks:
        sent = report.windows.get(leak.kind, {})
        lines.append(
            f"| {leak.kind} | {leak.intervals} | {sum(sent.values())} ({sent.get('ok', 0)}) "
            f"| {leak.in_flight} | {_workers(leak.survivors)} "
            f"| **{leak.leaked_sum}** / {leak.leaked_max} | {_workers(leak.restarted)} "
            f"| {leak.restarted_leaked_sum} / {leak.restarted_leaked_max} |"
        )
    lines += [
        "",
        "Errors, by the fault being played out when the request was sent (`load`: none):",
        "",
        "| during | error | count | expected |",
        "|---|---|---|---|",
    ]
    rows = [
        f"| {e.window} | {e.detail.replace('|', '/')} | {e.count} "
        f"| {'yes' if e.expected else '**no**'} |"
        for e in report.errors
    ]
    lines += rows or ["| - | none | 0 | - |"]
    return "\n".join(lines + _fault_lines(report))


def _fault_lines(report: SoakReport) -> list[str]:
    """The per-kind measurements (``measure``): none for reports written before them."""
    if not report.fault_summary:
        return []
    s = report.settings
    lines = [
        "",
        "Each fault measured, per kind (median / max over its faults; seconds from the signal "
        f"or the restart): detected = the gateway's membership counts the victim gone (target "
        f"{s.detect_target_s:g} s); alive again = the gateway counts it alive again (a killed "
        "worker: started again, with a new epoch); served again = the victim finished a request "
        "again; full throughput = token-exact 200s per second back to 90% of the load interval "
        f"before the fault, in every {s.rate_window_s:g} s window from then to the quiesce; "
        "migrations = requests the gateway moved, by what they lost, over the fault's window:",
        "",
        "| fault | times | detected | alive again | served again | full throughput "
        "| throughput in the window / before | migrations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in report.fault_summary:
        victim = f.kind in DETECTION_KINDS
        detect = f"{_s(f.detect_median_s)} / {_s(f.detect_max_s)}" if victim else "n/a"
        if f.undetected:
            detect += f", **{f.undetected} never**"
        served = f"{_s(f.back_median_s)} / {_s(f.back_max_s)}" if victim else "n/a"
        if f.not_served_again:
            served += f", {f.not_served_again} not in the window"
        full = f"{_s(f.recovery_median_s)} / {_s(f.recovery_max_s)}"
        if f.not_recovered:
            full += f", {f.not_recovered} not in the window"
        share = "-" if f.rate_share is None else _share(f.rate_share)
        moves = ", ".join(f"{lost} {n}" for lost, n in f.migrations.items() if n) or "0"
        rejoin = _s(f.rejoin_median_s) if victim else "n/a"
        lines.append(
            f"| {f.kind} | {f.count} | {detect} | {rejoin} | {served} | {full} | {share} "
            f"| {moves} |"
        )
    return lines
