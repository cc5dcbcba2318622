"""The targets of a GPU serving run (``meta.device == "cuda"``), computed from its points.

Issue 16's targets, each met or missed from the medians over the repeats, with every point of
its scope listed (``summary.Verdict``):

- G1-G3: P99 TTFT of vllm-pull (as shipped) / kvpush-push >= 2.0, vllm-pull-tuned / kvpush-push
  >= 1.3, vllm-push / kvpush-push >= 1.5, at every QPS point from half of vllm-pull's
  saturation up. vllm-pull's saturation in a table is the most requests per second it completed
  at any QPS point of that table (what it sustains; a point offering more only queues).
- G4: P50 TTFT kvpush-push / aggregated <= 1.05 at low load (c=1 and QPS points at most 0.25x
  of the capacity).
- G5: kvpush's own time in the TTFT at c=1, from its breakdown: every part but P's prefill
  compute and D's first engine step (gateway, bus and P's queue, the push tail, D learning the
  KV landed, streaming), each part's P50 summed; <= 3 ms. Where P sampled the first token
  (``first_token_by`` prefill) D runs no model for it: its ``decode_first_step`` (taking P's
  token up and reporting it) is kvpush's own time and counts too.
- G6: token identity of kvpush-push and kvpush-pull with the aggregated engine: the share of
  requests (same prompts, greedy) whose completions are identical, per point; 100 %. Every
  other disaggregated system is listed against the aggregated engine as well (informational:
  vLLM's own P/D shows what bf16 batch shapes alone change).

A point meets a ratio target only when both systems' transfer checks passed and neither had
errors (``summary.verdicts``' rules).

Threading model: pure functions over immutable inputs.
"""

from __future__ import annotations

from kvpush.benchmarks.serve.results import Document
from kvpush.benchmarks.serve.summary import (
    REFERENCE,
    Row,
    Target,
    Verdict,
    VerdictPoint,
    _median,
    judge,
    verdict_point,
)
from kvpush.benchmarks.serve.summary import (
    verdicts as ratio_verdicts,
)

OVERHEAD_PARTS = ("gateway", "queue_prefill", "push_tail", "decode_wait", "streaming")
HAND_OFF = ("decode_first_step",)  # with P's first token: D reports it, no model step
OVERHEAD_MS = 3.0
IDENTITY_SYSTEMS = ("kvpush-push", "kvpush-pull")


def saturation(all_rows: list[Row]) -> dict[tuple[str, int], float]:
    """Per table: the most requests per second vllm-pull completed at a QPS point."""
    found: dict[tuple[str, int], float] = {}
    for row in all_rows:
        if row.system != "vllm-pull" or row.load_kind != "qps":
            continue
        req_s = _median(row, "req_s")
        if req_s is not None:
            found[row.table] = max(found.get(row.table, 0.0), req_s)
    return found


def _low_load(row: Row) -> bool:
    if row.load_kind == "concurrency":
        return row.load <= 1
    return row.capacity_fraction is not None and row.capacity_fraction <= 0.25


def targets(all_rows: list[Row]) -> tuple[Target, ...]:
    sat = saturation(all_rows)

    def loaded(row: Row) -> bool:
        return row.load_kind == "qps" and row.table in sat and row.load >= 0.5 * sat[row.table]

    scope = "QPS points >= 0.5x vllm-pull's saturation"
    return (
        Target("G1", "P99 TTFT vs vllm-pull >= 2.0x", scope, "vllm-pull", "ttft_p99", 2.0, False,
               loaded),
        Target("G2", "P99 TTFT vs vllm-pull-tuned >= 1.3x", scope, "vllm-pull-tuned", "ttft_p99",
               1.3, False, loaded),
        Target("G3", "P99 TTFT vs vllm-push >= 1.5x", scope, "vllm-push", "ttft_p99", 1.5, False,
               loaded),
        Target("G4", "P50 TTFT <= 1.05x aggregated at low load",
               "c=1 and QPS points <= 0.25x capacity", "aggregated", "ttft_p50", 1.05, True,
               _low_load),
    )  # fmt: skip


def overhead(all_rows: list[Row]) -> Verdict:
    points = []
    for row in all_rows:
        if row.system != REFERENCE or row.load_kind != "concurrency" or row.load > 1:
            continue
        parts = row.breakdown or {}
        names = OVERHEAD_PARTS + (HAND_OFF if row.first_token_by == "prefill" else ())
        if not all(name in parts for name in names):
            points.append(verdict_point(row, None, False, "no data"))
            continue
        value = round(sum(parts[name] for name in names), 3)
        points.append(verdict_point(row, value, value <= OVERHEAD_MS))
    text = f"kvpush's own time in the TTFT <= {OVERHEAD_MS:g} ms"
    ratio = "ms: " + " + ".join(OVERHEAD_PARTS) + " (P50 each)"
    ratio += f"; + {HAND_OFF[0]} where P sampled the first token"
    return judge("G5", text, "c=1", ratio, points)


def identity(document: Document, engine: str = "aggregated") -> tuple[Verdict, list[Verdict]]:
    """G6 over kvpush's systems; and the same share for every other disaggregated system
    (``engine``: the one-engine system they are compared with)."""
    local = {
        (p.dataset, p.input_len, p.point, p.repeat): p
        for p in document.points
        if p.system == engine
    }
    by_system: dict[str, list[VerdictPoint]] = {}
    for p in document.points:
        if p.system in (engine, "aggregated"):
            continue
        ref = local.get((p.dataset, p.input_len, p.point, p.repeat))
        if ref is None or not p.output_digests or not ref.output_digests:
            by_system.setdefault(p.system, []).append(verdict_point(p, None, False, "no data"))
            continue
        pairs = [
            (a, b) for a, b in zip(p.output_digests, ref.output_digests, strict=False) if a and b
        ]
        share = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        # a request that failed on either side is not compared: the point proves nothing of it
        why = "no data" if not pairs else ("errors" if p.errors or ref.errors else "")
        met = share == 1.0 and not why
        by_system.setdefault(p.system, []).append(verdict_point(p, share, met, why))
    ours = [vp for name in IDENTITY_SYSTEMS for vp in by_system.get(name, [])]
    ratio = "share of requests with identical completions (kvpush-push points, then kvpush-pull)"
    main = judge("G6", "token identity with the aggregated engine: 100 %", "every point",
                    ratio, ours)  # fmt: skip
    others = [
        judge(f"G6 ({name})", f"{name}: token identity with the aggregated engine",
                 "every point (informational)", "share of identical completions", points)
        for name, points in by_system.items() if name not in IDENTITY_SYSTEMS
    ]  # fmt: skip
    return main, others


def verdicts(document: Document, all_rows: list[Row]) -> list[Verdict]:
    main, others = identity(document)
    return [*ratio_verdicts(all_rows, targets(all_rows)), overhead(all_rows), main, *others]
