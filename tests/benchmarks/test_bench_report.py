"""The serving benchmark's summary and report on synthetic data: the median and min-max over
repeats, merged transfer checks, the target verdicts (every point listed, errors meet nothing),
the generated document (markers, ``--check``), the plots, and that the committed
docs/benchmarks/serve.md is what its JSON generates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from PIL import Image

from kvpush.benchmarks.serve import report, results, summary

REPO = Path(__file__).resolve().parents[2]


def _check(ok: bool = True, applies: bool = True, n: int = 10) -> dict[str, Any]:
    if not applies:
        return {"applies": False, "ok": True, "detail": "n/a: one engine, no transfer"}
    return {
        "applies": True,
        "ok": ok,
        "checked": n,
        "without_transfer": 0 if ok else 2,
        "detail": "received 10/10" if ok else "2 fallback (D computed the prompt)",
    }


def _point(
    system: str,
    point: str,
    repeat: int,
    ttft: float,
    *,
    input_len: int = 2048,
    check: dict[str, Any] | None = None,
) -> dict[str, Any]:
    concurrency = point.startswith("c=")
    fraction = None if concurrency else float(point.rstrip("x"))
    return {
        "system": system,
        "dataset": "random",
        "input_len": input_len,
        "point": point,
        "label": point if concurrency else f"qps {fraction * 2:g}",
        "load_kind": "concurrency" if concurrency else "qps",
        "load": 1.0 if concurrency else fraction * 2,
        "capacity_fraction": fraction,
        "repeat": repeat,
        "requests": 10,
        "completed": 10,
        "errors": 0,
        "request_throughput": 1.0,
        "output_throughput": 32.0,
        "ttft_ms": {"mean": ttft, "p50": ttft * 0.9, "p99": ttft * 2},
        "tpot_ms": {"mean": 10.0, "p50": 10.0, "p99": 12.0},
        "itl_ms": {"mean": 10.0, "p50": 10.0, "p99": 12.0},
        "e2e_ms": {"mean": ttft + 310, "p50": ttft + 300, "p99": ttft * 2 + 400},
        "transfer_check": check or _check(applies=system != "aggregated"),
    }


def _document(points: list[dict[str, Any]]) -> results.Document:
    meta = {"tables": ["random:2048"], "repeats": 3, "output_len": 32, "argv": ["bench"]}
    return results.loads(json.dumps({"schema": 2, "meta": meta, "points": points}))


def _synthetic() -> results.Document:
    """kvpush-push wins 2.5x on P99 at 0.9x, loses at 0.75x; vllm-push fails a check in r2."""
    points = []
    for repeat, scale in enumerate((1.0, 1.2, 0.9)):
        for point, ours, pull, push in (("c=1", 500, 700, 800), ("0.75x", 900, 1000, 2000)):
            points += [
                _point("kvpush-push", point, repeat, ours * scale),
                _point("vllm-pull", point, repeat, pull * scale),
                _point("aggregated", point, repeat, 480 * scale),
            ]
            bad = _check(ok=False) if (point, repeat) == ("0.75x", 1) else None
            points.append(_point("vllm-push", point, repeat, push * scale, check=bad))
        points += [
            _point("kvpush-push", "0.9x", repeat, 1000 * scale),
            _point("vllm-pull", "0.9x", repeat, 2500 * scale),
            _point("vllm-push", "0.9x", repeat, 3000 * scale),
            _point("aggregated", "0.9x", repeat, 1100 * scale),
        ]
    return _document(points)


def test_rows_give_median_and_min_max_over_repeats_and_merge_checks() -> None:
    rows = {(r.point, r.system): r for r in summary.rows(_synthetic())}
    ours = rows[("c=1", "kvpush-push")]
    assert ours.figures["ttft_mean"] == summary.Spread(500.0, 450.0, 600.0, 3)
    assert ours.runs == 3 and ours.completed == 30 and ours.check.ok
    assert ours.check.checked == 30
    assert not rows[("c=1", "aggregated")].check.applies
    push = rows[("0.75x", "vllm-push")]
    assert not push.check.ok and push.check.failed_repeats == [2]
    assert push.check.without_transfer == 2 and push.check.details[0].startswith("r2: 2 fallback")
    assert [r.point for r in summary.rows(_synthetic())][::4] == ["c=1", "0.75x", "0.9x"]
    assert summary.spread([3.0, None, 1.0]) == summary.Spread(2.0, 1.0, 3.0, 2)


def test_verdicts_from_the_medians_list_every_point() -> None:
    found = {v.key: v for v in summary.verdicts(summary.rows(_synthetic()))}
    t1 = found["T1"]  # P99 vs vllm-pull >= 2x at >= 0.75x: 0.75x misses (1.11), 0.9x meets
    assert t1.verdict == "missed"
    assert [(p.point, p.value, p.met) for p in t1.points] == [
        ("0.75x", 1.111, False),
        ("0.9x", 2.5, True),
    ]
    t3 = found["T3"]  # vs vllm-push >= 1.2x: the 0.75x point's check failed in r2
    assert t3.verdict == "missed"
    assert [(p.point, p.met, p.why) for p in t3.points] == [
        ("c=1", True, ""),
        ("0.75x", False, "transfer check failed"),
        ("0.9x", True, ""),
    ]
    t4 = found["T4"]  # P50 <= 1.10x aggregated at low load: c=1 only (no 0.25x point here)
    assert [(p.point, p.value, p.met) for p in t4.points] == [("c=1", 1.042, True)]
    assert t4.verdict == "met"
    without_pull = _document(
        [p for p in msgspec_points(_synthetic()) if p["system"] != "vllm-pull"]
    )
    assert {v.key: v.verdict for v in summary.verdicts(summary.rows(without_pull))} == {
        "T1": "not measured",
        "T2": "not measured",
        "T3": "missed",
        "T4": "met",
    }


def msgspec_points(document: results.Document) -> list[dict[str, Any]]:
    return json.loads(results.dumps(document))["points"]


def test_a_point_with_errors_meets_no_target() -> None:
    """The survivors' TTFT of a point where requests failed is no measure of it."""
    points = msgspec_points(_synthetic())
    for p in points:
        if p["system"] == "kvpush-push" and p["point"] == "0.9x" and p["repeat"] == 1:
            p["errors"] = 1
    found = {v.key: v for v in summary.verdicts(summary.rows(_document(points)))}
    assert [(p.point, p.met, p.why) for p in found["T1"].points] == [
        ("0.75x", False, ""),
        ("0.9x", False, "errors"),
    ]


def test_report_marks_failed_points_and_shows_spreads_ratios_and_verdicts() -> None:
    text = report.render(_synthetic(), plots_prefix="serve/")
    assert "| c=1 | kvpush-push | 500 [450–600] | 450 [405–540] | 1000 [900–1200] |" in text
    assert "| ok (30) |" in text and "| n/a |" in text
    assert "| qps 1.5 (0.75x) | **vllm-push** |" in text and "**FAILED** (2 of 30)" in text
    assert "- vllm-push, qps 1.5, r2: 2 fallback (D computed the prompt)" in text
    assert "| qps 1.8 (0.9x) | vllm-pull | 2.50 | 2.50 | 2.50 | 1.00 |" in text
    assert "| qps 1.5 (0.75x) | vllm-push † | 2.22 |" in text
    assert "| T1: P99 TTFT vs vllm-pull >= 2.0x at high QPS, 2k prompts |" in text
    assert "| TTFT P99 vllm-pull / kvpush-push | **missed** | 1 of 2 |" in text
    assert "| TTFT P50 kvpush-push / aggregated | **met** | 1 of 1 |" in text
    assert "**random 2048 qps 1.5 (0.75x): 1.11**; random 2048 qps 1.8 (0.9x): 2.50" in text
    assert "![TTFT vs QPS, random 2048](serve/ttft-random-2048.png)" in text


def test_generated_part_is_spliced_into_prose_and_checked(tmp_path: Path) -> None:
    data = tmp_path / "serve" / "results.json"
    data.parent.mkdir()
    data.write_text(results.dumps(_synthetic()))
    doc = tmp_path / "serve.md"
    doc.write_text("# Serving benchmark\n\nProse that explains.\n")
    assert report.check_doc(doc, data) is not None  # no generated part yet
    assert report.write_doc(doc, data) and not report.write_doc(doc, data)
    text = doc.read_text()
    assert text.startswith("# Serving benchmark\n\nProse that explains.\n\n<!-- generated: serve (")
    assert "kvpush bench report " in text and "serve/results.json --out " in text
    assert "(serve/ttft-random-2048" in text
    assert report.check_doc(doc, data) is None
    doc.write_text(text + "\nMore prose after the tables.\n")
    assert report.check_doc(doc, data) is None  # prose outside the markers is free
    doc.write_text(text.replace("500 [450–600]", "480 [450–600]"))
    assert "not what its data generates" in (report.check_doc(doc, data) or "")
    ns = argparse.Namespace(results=str(data), out=str(doc), check=True, plots=False)
    assert report.main(ns) == 1
    assert report.main(argparse.Namespace(**{**vars(ns), "check": False})) == 0
    assert report.main(ns) == 0 and doc.read_text().startswith("# Serving benchmark\n")


def test_committed_serve_doc_is_generated_from_its_results() -> None:
    doc = REPO / "docs" / "benchmarks" / "serve.md"
    assert report.check_doc(doc, REPO / "docs" / "benchmarks" / "serve" / "results.json") is None


def test_plots_use_the_medians(tmp_path: Path) -> None:
    [png] = report.plots(_synthetic(), tmp_path)
    assert png.name == "ttft-random-2048.png"
    with Image.open(png) as image:
        assert image.size[0] >= 1000
        colors = {c for _, c in image.getcolors(1 << 20)}
        assert (214, 39, 40) in colors and (31, 119, 180) in colors  # both systems drawn


def test_first_format_documents_still_load() -> None:
    old = {
        "meta": {"output_len": 32},
        "points": [{k: v for k, v in _point("vllm-pull", "c=1", 0, 700).items() if k in OLD}],
    }
    document = results.loads(json.dumps(old))
    [point] = document.points
    assert point.point == "c=1" and point.repeat == 0 and point.transfer_check is None
    [row] = summary.rows(document)
    assert row.check.unchecked_repeats == [1] and not row.check.ok


OLD = {
    "system",
    "dataset",
    "input_len",
    "label",
    "load_kind",
    "load",
    "requests",
    "completed",
    "errors",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
}


def test_a_panel_spanning_decades_gets_log_ticks() -> None:
    from kvpush.benchmarks.serve import plot

    assert plot._log_ticks(60.0, 13000.0) == [50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
    assert plot._log_ticks(100.0, 100.0) == [100.0]
