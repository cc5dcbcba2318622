"""The targets of a GPU serving run (``summary_gpu``) on synthetic points: the ratio targets'
scope follows vllm-pull's measured saturation, kvpush's own time comes from the breakdown, and
token identity compares each request's completion with the aggregated engine's."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvpush.benchmarks.serve import report, results, summary, summary_engines, summary_gpu


def _point(system: str, point: str, ttft: float, req_s: float, **extra: Any) -> dict[str, Any]:
    concurrency = point.startswith("c=")
    qps = None if concurrency else float(point.split()[1])
    row = {
        "system": system,
        "dataset": "random",
        "input_len": 2048,
        "point": point,
        "label": point,
        "load_kind": "concurrency" if concurrency else "qps",
        "load": 1.0 if concurrency else qps,
        "capacity_fraction": None if concurrency else qps / 20,
        "requests": 4,
        "completed": 4,
        "errors": 0,
        "request_throughput": req_s,
        "ttft_ms": {"mean": ttft, "p50": ttft, "p99": ttft * 2},
        "transfer_check": {"applies": system != "aggregated", "ok": True, "checked": 4},
        "output_digests": extra.pop("digests", ["a", "b", "c", "d"]),
    }
    return {**row, **extra}


def _document() -> results.Document:
    parts = {"gateway": 0.4, "queue_prefill": 0.6, "prefill_compute": 50.0, "push_tail": 0.3}
    parts |= {"decode_wait": 0.9, "decode_first_step": 12.0, "streaming": 0.5}
    breakdown = {name: {"p50": value} for name, value in parts.items()}
    points = []
    for point, pull_req_s in (("c=1", 1.0), ("qps 1", 0.9), ("qps 2", 1.5), ("qps 8", 1.6)):
        # vllm-pull saturates at 1.6 req/s: its scope starts at qps 0.8, so qps 1 and up
        points += [
            _point("kvpush-push", point, 60.0, 1.0, breakdown=breakdown),
            _point("kvpush-pull", point, 70.0, 1.0, digests=["a", "b", "x", "d"]),
            _point("vllm-pull", point, 700.0 if point != "qps 1" else 100.0, pull_req_s),
            _point("vllm-pull-tuned", point, 70.0, 1.0),
            _point("vllm-push", point, 200.0, 1.0),
            _point("aggregated", point, 55.0, 1.0),
        ]
    meta = {"device": "cuda", "tables": ["random:2048"], "repeats": 1, "output_len": 32}
    return results.loads(json.dumps({"schema": 2, "meta": meta, "points": points}))


def test_gpu_targets_scope_overhead_and_identity() -> None:
    document = _document()
    rows = summary.rows(document)
    assert summary_gpu.saturation(rows) == {("random", 2048): 1.6}
    found = {v.key: v for v in summary_engines.verdicts_of(document, rows)}
    g1 = found["G1"]
    assert [p.label for p in g1.points] == ["qps 1", "qps 2", "qps 8"]  # c=1 is out of scope
    assert g1.verdict == "missed" and [p.met for p in g1.points] == [False, True, True]
    assert found["G2"].verdict == "missed" and found["G3"].verdict == "met"  # 1.17x, 3.33x
    assert found["G4"].verdict == "missed"  # 60 / 55 = 1.09 at c=1 and 0.05x
    g5 = found["G5"]
    assert [(p.label, p.value, p.met) for p in g5.points] == [("c=1", 2.7, True)]
    g6 = found["G6"]
    shares = [(p.label, p.value) for p in g6.points]
    assert shares[:4] == [("c=1", 1.0), ("qps 1", 1.0), ("qps 2", 1.0), ("qps 8", 1.0)]
    assert shares[4:] == [("c=1", 0.75), ("qps 1", 0.75), ("qps 2", 0.75), ("qps 8", 0.75)]
    assert g6.verdict == "missed"  # kvpush-pull answered one request of four differently
    assert found["G6 (vllm-pull)"].verdict == "met"
    # the order of the points (systems run in turn, rotated per repeat) changes nothing
    shuffled = results.Document(meta=document.meta, points=document.points[::-1])
    again = {v.key: v for v in summary_engines.verdicts_of(shuffled, summary.rows(shuffled))}
    assert sorted((p.label, p.value) for p in again["G6"].points) == sorted(shares)
    text = report.render(document)
    assert "G1: P99 TTFT vs vllm-pull >= 2.0x" in text and "**missed**" in text
    failed = _document()
    failed.points[1].output_digests = ["a", "b", "x", ""]  # kvpush-pull: one request failed
    failed.points[1].errors = 1
    g6 = {v.key: v for v in summary_engines.verdicts_of(failed, summary.rows(failed))}["G6"]
    assert [(p.value, p.why) for p in g6.points][4] == (2 / 3, "errors")
    cpu = results.Document(meta={}, points=document.points)
    assert {v.key for v in summary_engines.verdicts_of(cpu, rows)} == {"T1", "T2", "T3", "T4"}


def test_with_prefill_s_first_token_decode_s_hand_off_is_kvpush_s_own_time() -> None:
    """D runs no model step for a first token P sampled: its decode_first_step (taking P's
    token up, reporting it) counts in G5; a point of a run without it keeps it out."""
    document = _document()
    for point in document.points:
        if point.system == "kvpush-push":
            point.first_token_by = "prefill"
    rows = summary.rows(document)
    g5 = {v.key: v for v in summary_engines.verdicts_of(document, rows)}["G5"]
    assert [(p.label, p.value, p.met) for p in g5.points] == [("c=1", 14.7, False)]


def _engines_document(starts: dict[str, list[float]]) -> results.Document:
    """kvpush-push against vllm-serve and vLLM's P/D, every engine on its default flags."""
    points = []
    figures = {  # system: (TTFT P50, P99 is twice; TPOT; out tok/s at qps 8)
        "kvpush-push": (60.0, 5.0, 480.0),
        "vllm-serve": (56.0, 4.8, 500.0),
        "vllm-pull-tuned": (75.0, 5.0, 450.0),
        "vllm-push": (70.0, 4.9, 470.0),
    }
    for system, (ttft, tpot, out) in figures.items():
        for point, req_s in (("c=1", 1.0), ("qps 4", 4.0), ("qps 8", 7.0), ("qps 12", 8.0)):
            for repeat, start_s in enumerate(starts.get(system, [100.0])):
                loaded = ttft * (3 if point == "qps 12" else 1)
                points.append(
                    _point(
                        system,
                        point,
                        loaded,
                        req_s if system == "vllm-serve" else min(req_s, 7.5),
                        repeat=repeat,
                        start_s=start_s,
                        tpot_ms={"mean": tpot, "p50": tpot, "p99": tpot},
                        output_throughput=out if point != "c=1" else 10.0,
                    )
                )
    meta = {"device": "cuda", "tables": ["random:2048"], "repeats": 2, "output_len": 64}
    return results.loads(json.dumps({"schema": 2, "meta": meta, "points": points}))


def test_a_run_with_vllm_serve_is_judged_by_the_engine_targets() -> None:
    """With vllm-serve among the systems: TPOT and TTFT against it (P99 up to its knee,
    throughput past it), P99 and TPOT against vLLM's P/D, cold start and restart."""
    from kvpush.benchmarks.serve import summary_engines

    document = _engines_document({"kvpush-push": [150.0, 55.0], "vllm-serve": [100.0, 40.0]})
    rows = summary.rows(document)
    assert summary_engines.knees(rows) == {("random", 2048): 8.0}
    found = {v.key: v for v in summary_engines.verdicts_of(document, rows)}
    assert "G1" not in found and {"E1", "E9", "E10", "G5", "G6"} <= set(found)
    e1 = found["E1"]  # TPOT 5.0 / 4.8 = 1.042 at every point
    assert e1.verdict == "met" and len(e1.points) == 4 and e1.points[0].value == 1.042
    assert [(p.label, p.value) for p in found["E2"].points] == [("c=1", 1.071)]
    assert found["E2"].verdict == "missed"
    assert [p.label for p in found["E3"].points] == ["c=1", "qps 4", "qps 8"]  # up to 8 req/s
    e4 = found["E4"]  # past the knee: qps 12; 480 / 500
    assert [(p.label, p.value, p.met) for p in e4.points] == [("qps 12", 0.96, True)]
    assert found["E5"].verdict == "missed"  # 75 / 60 = 1.25 < 1.5
    assert found["E7"].verdict == "met" and found["E8"].verdict == "missed"  # 5.0 vs 4.9
    assert [(p.value, p.met) for p in found["E9"].points] == [(1.5, True)]  # 150 / 100
    assert [(p.value, p.met) for p in found["E10"].points] == [(55.0, True)]
    once = _engines_document({"kvpush-push": [150.0], "vllm-serve": [100.0]})
    again = {v.key: v for v in summary_engines.verdicts_of(once, summary.rows(once))}
    assert again["E10"].verdict == "not measured"  # one start: no restart measured
    once.systems["kvpush-push"] = {"ok": True, "runs": [{"repeat": 0, "restart_s": 62.5}]}
    restarted = {v.key: v for v in summary_engines.verdicts_of(once, summary.rows(once))}
    assert [(p.value, p.met) for p in restarted["E10"].points] == [(62.5, False)]  # --restart
    assert "E1: TPOT mean <= 1.10x vllm-serve" in report.render(document)


def test_cold_start_and_restart_are_judged_for_every_kvpush_system() -> None:
    """Push and pull start the same engines: each kvpush system's starts are a point of E9, and
    E10 has a point for each that started again (here pull, by --restart); eager rows stay out."""
    document = _engines_document({"kvpush-push": [160.0], "vllm-serve": [100.0]})
    for name, start_s in (("kvpush-pull", 120.0), ("kvpush-push-eager", 50.0)):
        for point in [p for p in document.points if p.system == "kvpush-push"]:
            document.points.append(msgspec.structs.replace(point, system=name, start_s=start_s))
    document.systems["kvpush-pull"] = {"ok": True, "runs": [{"repeat": 0, "restart_s": 38.1}]}
    found = {v.key: v for v in summary_engines.verdicts_of(document, summary.rows(document))}
    e9 = [(p.label, p.value, p.met) for p in found["E9"].points]
    assert e9 == [("kvpush-push cold", 1.6, False), ("kvpush-pull cold", 1.2, True)]
    assert found["E9"].verdict == "missed"
    e10 = [(p.label, p.value, p.met) for p in found["E10"].points]
    assert e10 == [("kvpush-pull restart", 38.1, True)] and found["E10"].verdict == "met"
    starts = {name: (cold, warm) for name, cold, warm in summary_engines.start_rows(document)}
    assert starts["kvpush-pull"] == (120.0, 38.1) and starts["kvpush-push"] == (160.0, None)
    assert "| kvpush-pull | 120.0 | 38.1 |" in report.render(document)  # the table E9/E10 read
