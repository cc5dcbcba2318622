"""Committed docs carry tables generated from committed JSON: they must be exactly what the data
generates (a hand edit of a number, or new data without regenerating, fails here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.benchmarks import docgen, idle, push_split_report, transport_report

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_splice_appends_a_section_once_and_then_replaces_only_its_body() -> None:
    text = "# Title\n\nProse 1.5 ms.\n"
    once = docgen.splice(text, "t", "| a |\n|---|\n| 1 |", "make it")
    assert once.startswith(text.rstrip()) and docgen.section(once, "t") == "| a |\n|---|\n| 1 |"
    twice = docgen.splice(once + "\nMore prose.\n", "t", "| a |\n|---|\n| 2 |", "make it")
    assert docgen.section(twice, "t") == "| a |\n|---|\n| 2 |"
    assert twice.count("<!-- generated: t (make it): do not edit -->") == 1
    assert twice.endswith("More prose.\n") and "Prose 1.5 ms." in twice


def test_update_with_check_refuses_a_doc_that_differs_from_its_data(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n")
    assert docgen.update(doc, "t", "| x |", "regen") is True
    assert docgen.update(doc, "t", "| x |", "regen", check=True) is False
    # the marker's command may name other paths (another checkout): only the body counts
    assert docgen.update(doc, "t", "| x |", "regen /elsewhere", check=True) is False
    doc.write_text(doc.read_text().replace("| x |", "| y |"))  # a hand edit
    with pytest.raises(docgen.DocOutOfDate, match="regen"):
        docgen.update(doc, "t", "| x |", "regen", check=True)


def test_transport_md_tables_are_what_the_committed_runs_generate() -> None:
    runs = transport_report.load_runs(DOCS / "benchmarks" / "transport")
    assert len(runs) >= 3
    body = transport_report.summary(runs)
    doc = DOCS / "benchmarks" / "transport.md"
    assert not docgen.update(doc, "transport", body, transport_report.REPORT_COMMAND, check=True)


def test_connector_md_time_split_is_what_the_committed_run_generates() -> None:
    path = DOCS / "benchmarks" / "push-split.json"
    body = push_split_report.table(json.loads(path.read_text()))
    doc = DOCS / "connector.md"
    command = push_split_report.REPORT_COMMAND
    assert not docgen.update(doc, push_split_report.SECTION, body, command, check=True)


def test_connector_md_waiting_cost_is_what_the_committed_run_generates() -> None:
    results = json.loads((DOCS / "benchmarks" / "idle.json").read_text())
    assert {(r["mode"], r["tp"]) for r in results["modes"]} == set(idle.MODES)
    body = idle.table(results)
    doc = DOCS / "connector.md"
    assert not docgen.update(doc, "idle", body, idle.REPORT_COMMAND, check=True)


def test_transport_summary_refuses_runs_of_different_settings(tmp_path: Path) -> None:
    runs = sorted((DOCS / "benchmarks" / "transport").glob("run-*.json"))
    first = json.loads(runs[0].read_text())
    (tmp_path / "run-1.json").write_text(json.dumps(first))
    for case in first["cases"]:
        case["repeats"] = 3  # a quick run next to the committed ones
    (tmp_path / "run-2.json").write_text(json.dumps(first))
    with pytest.raises(ValueError, match="differ"):
        transport_report.load_runs(tmp_path)


def test_gpu_md_serving_check_is_what_the_committed_run_generates() -> None:
    from tests.gpu import gpu_serve

    run = json.loads((DOCS / "benchmarks" / "gpu-serve-check.json").read_text())
    moved = [a for row in run["rows"] for a in row["answers"] if a["mode"] != "local"]
    assert moved and all(a["same_as_local"] and a["kv"] == "received" for a in moved)
    body = gpu_serve.table(run)
    doc = DOCS / "benchmarks" / "gpu.md"
    assert not docgen.update(doc, "gpu-serve", body, gpu_serve.REPORT_COMMAND, check=True)


def test_gpu_md_vllm_frontend_check_is_what_the_committed_run_generates() -> None:
    from tests.gpu import gpu_serve

    run = json.loads((DOCS / "benchmarks" / "gpu-serve-check-vllm.json").read_text())
    moved = [a for row in run["rows"] for a in row["answers"] if a["mode"] != "local"]
    assert moved and all(a["same_as_local"] and a["kv"] == "received" for a in moved)
    assert run["frontend"] == "vllm" and {s for s, _ in run["features"].values()} == {200}
    name, command = gpu_serve.section_of(run)
    doc = DOCS / "benchmarks" / "gpu.md"
    assert not docgen.update(doc, name, gpu_serve.table(run), command, check=True)


def test_gpu_md_swap_and_transport_sections_are_what_the_committed_runs_generate() -> None:
    from tests.gpu import gpu_swap

    doc = DOCS / "benchmarks" / "gpu.md"
    for name, section in gpu_swap.SECTIONS.items():
        run = json.loads((DOCS / "benchmarks" / name).read_text())
        assert all(r["a_differs_from_b"] for r in run["rows"])  # the weights see the context
        command = gpu_swap.report_command(name)
        assert not docgen.update(doc, section, gpu_swap.table(run), command, True), name
    body = transport_report.gpu_summary(DOCS / "benchmarks" / "gpu-transport")
    assert not docgen.update(doc, "gpu-transport", body, transport_report.GPU_REPORT_COMMAND, True)


ENGINE_PARTS = (
    "vllm-serve-1",
    "kvpush-push-1",
    "kvpush-pull-1",
    "vllm-pull-tuned-1",
    "vllm-push-1",
    "kvpush-push-mps-1",
)


def _joined_doc_agrees(doc: Path, folder: Path, parts: list[Path]) -> None:
    """``doc``'s tables are what ``folder``/results.json generates, and that results.json (its
    verdicts too) is what --join makes of ``parts`` in this order."""
    from kvpush.benchmarks.serve import join, report, results, summary, summary_engines

    joined = join.join([join.load_part(p) for p in parts])
    committed = results.load(folder / "results.json")
    assert [p.system for p in committed.points] == [p.system for p in joined.points]
    assert committed.points == joined.points and committed.meta == joined.meta
    rows = summary.rows(joined)
    assert msgspec_builtins(summary_engines.verdicts_of(joined, rows)) == committed.verdicts
    assert report.check_doc(doc, folder / "results.json") is None


def test_gpu_serve_md_is_the_join_of_issue_29_s_parts() -> None:
    """docs/benchmarks/gpu-serve.md (every engine on its users' default flags) is the join of
    the parts in gpu-serve/engines/, each part's own report what it generates."""
    from kvpush.benchmarks.serve import report

    folder = DOCS / "benchmarks" / "gpu-serve"
    parts = [folder / "engines" / f"{name}.json" for name in ENGINE_PARTS]
    _joined_doc_agrees(DOCS / "benchmarks" / "gpu-serve.md", folder, parts)
    for part in (*ENGINE_PARTS, "kvpush-push-before-fixes"):  # that one: cited, not joined
        doc, data = folder / "engines" / f"{part}.md", folder / "engines" / f"{part}.json"
        assert report.check_doc(doc, data) is None, part


def test_the_integrity_runs_reports_are_what_their_json_generates() -> None:
    """docs/benchmarks/gpu-serve/integrity/: kvpush-push with and without --kv-checksum."""
    from kvpush.benchmarks.serve import report

    runs = ("checksum", "checksum-c1", "checksum-c1-side", "checksum-side", "checksum-side-30s")
    runs += ("checksum-onepass", "checksum-3x", "checksum-late", "checksum-half")
    for run in runs:
        folder = DOCS / "benchmarks" / "gpu-serve" / "integrity" / run
        assert report.check_doc(folder / "results.md", folder / "results.json") is None, run


def test_the_eager_run_s_doc_is_the_join_of_its_committed_parts() -> None:
    """docs/benchmarks/gpu-serve-eager.md (the earlier run, every peer with --enforce-eager)
    is the join of its parts, and the reports of single parts it cites are what they generate."""
    from kvpush.benchmarks.serve import report

    folder = DOCS / "benchmarks" / "gpu-serve-eager"
    names = ("b-results.json", "a-results.partial.json", "c-vllm-pull-tuned.json")
    parts = [folder / "parts" / name for name in (*names, "d-aggregated.json", "e-kvpush.json")]
    _joined_doc_agrees(DOCS / "benchmarks" / "gpu-serve-eager.md", folder, parts)
    for cited in ("b-results", "kvpush-tcp-read"):
        doc, data = folder / "parts" / f"{cited}.md", folder / "parts" / f"{cited}.json"
        assert report.check_doc(doc, data) is None, cited


def msgspec_builtins(value: object) -> object:
    import msgspec

    return msgspec.to_builtins(value)


def test_api_md_parity_table_is_what_the_committed_run_generates() -> None:
    from kvpush.benchmarks import parity_report

    run = json.loads((DOCS / "benchmarks" / "parity.json").read_text())
    assert len(run["cases"]) >= 30
    assert all(c["push"] == c["pull"] == "same" for c in run["cases"])
    body = parity_report.body(run)
    doc = DOCS / "api.md"
    assert not docgen.update(doc, parity_report.NAME, body, parity_report.COMMAND, check=True)


@pytest.mark.parametrize("name", ["decision", "decision-alone", "decision-2746941"])
def test_routing_decision_md_is_what_the_committed_run_generates(name: str) -> None:
    """decision.md (the fleet names devices), decision-alone.md (``--no-devices``) and
    decision-2746941.md (the earlier run that missed)."""
    from kvpush.benchmarks import route

    folder = DOCS / "benchmarks" / "routing"
    results = json.loads((folder / f"{name}.json").read_text())
    assert results["meta"]["prefixes"] >= 10_000 and len(results["cases"]) == 12
    assert results["meta"]["devices"] == (
        "none named" if name.endswith("alone") else "P i and D i on device i"
    )
    body = route.table(results)
    doc = folder / f"{name}.md"
    command = route.report_command(
        f"docs/benchmarks/routing/{name}.json", f"docs/benchmarks/routing/{name}.md"
    )
    assert not docgen.update(doc, route.SECTION, body, command, check=True)


def test_routing_results_md_is_what_the_committed_run_generates() -> None:
    """docs/benchmarks/routing/results.md (issue 32's reuse benchmark) from its results.json."""
    from kvpush.benchmarks.serve import routing_report

    folder = DOCS / "benchmarks" / "routing"
    if not (folder / "results.json").exists():
        pytest.skip("no routing benchmark run committed yet (docs/benchmarks/routing/results.json)")
    assert not routing_report.write_doc(folder / "results.md", folder / "results.json", check=True)


@pytest.mark.parametrize(
    "card",
    [
        "h200",
        "h100",
        "h100-reuse-1",
        "h100-reuse-2",
        "h100-dshare-1",
        "h100-dshare-2",
        "cpu-de667c3",
        "h200-dshare",
        "h100-c4-trace",
        "h100-c4",
        "h100-serial-off",
        "h100-serial-on-1",
        "h100-serial-on-2",
        "h100-head-1",
        "h100-head-2",
        "h100-block16",
        "h100-gil-1",
        "h100-gil-5000-1",
        "h100-gil-2",
        "h100-gil-5000-2",
        "cpu-c1-4c7b6b7",
        "load-h100",
        "load-h100-share",
        "load-h100-turns",
        "load-h100-1p1d",
        "load-h100-cold",
        "load-h100-1p1d-3x",
    ],
)
def test_routing_gpu_md_is_what_the_committed_gpu_run_generates(card: str) -> None:
    """docs/benchmarks/routing/<card>.md (issue 32 on one GPU: tests/gpu/h200.sh routing; its
    load target: routed-load)."""
    from kvpush.benchmarks.serve import routing_report

    folder = DOCS / "benchmarks" / "routing"
    doc, data = folder / f"{card}.md", folder / f"{card}.json"
    assert not routing_report.write_doc(doc, data, check=True)
    assert routing_report.report_command(data, doc) in doc.read_text()


@pytest.mark.parametrize(
    ("run", "system", "share", "decode_share"),
    [
        ("load-h100", "kvpush-routed", 0.25, None),
        ("load-h100-share", "kvpush-routed", 0.25, 0.4),
        ("load-h100-turns", "kvpush-routed", 0.25, 0.4),
        ("load-h100-cold", "kvpush-routed", 0.25, 0.4),
        ("load-h100-1p1d", "kvpush-routed-1p1d", 0.283, 0.567),
        ("load-h100-1p1d-3x", "kvpush-routed-1p1d", 0.283, 0.567),
    ],
)
def test_the_routed_load_runs_are_the_join_of_their_parts(
    run: str, system: str, share: float, decode_share: float | None
) -> None:
    """docs/benchmarks/routing/load-h100*.json: kvpush-routed and vllm-serve, each run alone on
    its own GPU memory share (tests/gpu/h200.sh routed-load), joined with --join."""
    from kvpush.benchmarks.serve import join, results

    folder = DOCS / "benchmarks" / "routing"
    parts = [folder / run / "parts" / f"{name}.json" for name in (system, "vllm-serve")]
    joined = join.join([join.load_part(p) for p in parts])
    committed = results.load(folder / f"{run}.json")
    assert committed.points == joined.points and committed.meta == joined.meta
    assert joined.meta["gpu_memory_utilization"] == {"vllm-serve": 0.4, system: share}
    assert joined.meta.get("decode_gpu_memory_utilization") == decode_share
