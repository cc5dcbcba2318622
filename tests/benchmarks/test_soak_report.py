"""The soak report: its verdict, its round trip through JSON, and the committed copy in the docs."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvpush.benchmarks import docgen, soak
from kvpush.benchmarks.soak import report
from kvpush.benchmarks.soak.accounting import (
    ErrorKind,
    IdleSample,
    PathCount,
    make_interval,
    summarize_leaks,
)
from kvpush.benchmarks.soak.measure import FaultRecord, summarize

DOCS = Path(__file__).resolve().parents[2] / "docs"


def settings(**changes: object) -> report.SoakSettings:
    base = report.SoakSettings(
        minutes=1, concurrency=4, fault_every_s=30, recovery_s=5, abort_share=0.1,
        stream_share=0.2, layer_delay_ms=100, prompts=40, max_tokens=8, seed=0,
        gateway_max_inflight=8, burst_clients=12, settle_timeout_s=60, min_success_share=0.7,
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def idle(worker: str, free: int = 100, epoch: int = 1) -> IdleSample:
    return IdleSample(worker, epoch, free, 100, 0, True, 1.0)


def synthetic(**changes: object) -> report.SoakReport:
    both = [idle("p"), idle("d")]
    intervals = [
        make_interval("load", 0, 0, both, both),
        make_interval("kill_prefill", 30, 4, both, [idle("p", 100, 2), idle("d")]),
    ]
    base = report.SoakReport(
        settings=settings(),
        wall_s=100,
        load_s=80,
        counts={"ok": 90, "aborted": 5, "expected_error": 10},
        sent=105,
        success_share=0.9,
        paths=[PathCount("push/received", 50, 10, 5, 0), PathCount("pull/received", 30, 0, 0, 0)],
        windows={"load": {"ok": 80}, "kill_prefill": {"ok": 10, "expected_error": 10}},
        errors=[ErrorKind("kill_prefill", "503 service_unavailable: no prefill worker", 10, True)],
        examples=[],
        faults={"kill_prefill": 1},
        intervals=intervals,
        leaks=summarize_leaks(intervals),
        gateway_kv_outcomes={"push/received": 60, "pull/received": 30},
        failures=[],
    )
    return msgspec.structs.replace(base, **changes)


def test_a_clean_report_passes() -> None:
    assert report.failures(synthetic()) == []


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"counts": {"ok": 90, "wrong": 1}}, "wrong tokens"),
        ({"counts": {"ok": 90, "unexpected": 2}}, "unexpected"),
        ({"success_share": 0.5}, "success share 0.500 below 0.7"),
        ({"faults": {}}, "no fault"),
        ({"paths": [PathCount("push/received", 1, 0, 0, 0)]}, "no pull/received"),
        ({"paths": [PathCount("local", 9, 9, 0, 0)]}, "no push/received"),
        (
            {"gateway_kv_outcomes": {"push/received": 59, "pull/received": 30}},
            "push/received: the gateway counted 59, the soak checked 60",
        ),
        ({"stopped_early": "client-0: RuntimeError('x')"}, "the run stopped early"),
        ({"faults": {"kill_prefill": 5}}, "fault burst never ran"),
    ],
)
def test_the_verdict_fails_for_each_reason(changes: dict[str, object], reason: str) -> None:
    assert any(reason in f for f in report.failures(synthetic(**changes)))


def test_a_leak_fails_the_verdict() -> None:
    leaky = [make_interval("burst", 10, 8, [idle("p"), idle("d")], [idle("p"), idle("d", 99)])]
    assert any("leaked" in f for f in report.failures(synthetic(intervals=leaky)))


def test_the_report_survives_json_and_renders_the_same(tmp_path: Path) -> None:
    original = synthetic(failures=["x"])
    path = tmp_path / "soak.json"
    path.write_bytes(report.dump(original))
    again = report.load(path)
    assert again == original and not again.passed
    table = report.markdown(again)
    assert table == report.markdown(original)
    assert "**FAIL**: x" in table and "| push/received | 50 | 10 | 5 | 0 |" in table
    assert "| kill_prefill | 1 | 20 (10) | 4 | d x1 | **0** / 0 | p x1 | 0 / 0 |" in table


KILLER = ("kill_prefill", "kill_decode", "stop_prefill", "stop_decode", "restart_nats")


def fault(kind: str, victim: str = "", detect_s: float | None = None) -> FaultRecord:
    return FaultRecord(
        kind=kind, victim=victim, at_s=30, in_flight=4, window_s=40, baseline_rate=4.0,
        fault_rate=3.6, detect_s=detect_s, rejoin_s=9.0 if victim else None,
        back_s=9.5 if victim else None, recovery_s=11.0, migrations={"decode": 3},
    )  # fmt: skip


def killer(faults: dict[str, int], records: list[FaultRecord] | None = None) -> report.SoakReport:
    """A 2P2D run of the killer's schedule."""
    records = records if records is not None else [fault("kill_decode", "soak-d1", 1.4)]
    s = settings(prefill=2, decode=2, faults=KILLER, schedule=report.KILLER,
                 min_success_share=0.999, fault_every_s=60)  # fmt: skip
    return synthetic(
        settings=s, faults=faults, success_share=1.0, fault_records=records,
        fault_summary=summarize(records), moved=3,
    )  # fmt: skip


ROUND = {"kill_prefill": 1, "kill_decode": 1, "stop_prefill": 1, "stop_decode": 1}


def test_the_killer_restarts_nats_exactly_once() -> None:
    assert report.failures(killer({**ROUND, "restart_nats": 1})) == []
    for times in (0, 2):
        found = report.failures(killer({**ROUND, "restart_nats": times}))
        assert found == [f"nats-server restarted {times} times, not once"]


def test_the_killer_wants_every_other_kind_once_a_whole_round_ran() -> None:
    found = report.failures(killer({"kill_decode": 4, "restart_nats": 1}))
    assert sorted(found) == [
        "fault kill_prefill never ran", "fault stop_decode never ran",
        "fault stop_prefill never ran",
    ]  # fmt: skip
    assert report.failures(killer({"kill_decode": 3, "restart_nats": 1})) == []


def test_a_kill_noticed_past_the_target_fails_the_verdict() -> None:
    late = [fault("kill_decode", "soak-d1", 2.3), fault("stop_prefill", "soak-p0", None)]
    found = report.failures(killer({**ROUND, "restart_nats": 1}, late))
    assert len(found) == 2 and "2.30 s (target 2 s)" in found[0] and "never" in found[1]


def test_the_fault_table_renders_per_kind() -> None:
    records = [fault("kill_decode", "soak-d1", 1.4), fault("restart_nats")]
    table = report.markdown(killer({**ROUND, "restart_nats": 1}, records))
    assert "on 2 prefill + 2 decode workers" in table and "nats-server restarted once" in table
    assert "| 90 (3) |" in table  # token-exact 200s, of them moved
    assert (
        "| kill_decode | 1 | 1.40 s / 1.40 s | 9.00 s | 9.50 s / 9.50 s | 11.00 s / 11.00 s "
        "| 90.0% | decode 3 |" in table
    )
    assert "| restart_nats | 1 | n/a | n/a | n/a | 11.00 s / 11.00 s | 90.0% | decode 3 |" in table
    again = msgspec.json.decode(report.dump(killer({}, records)), type=report.SoakReport)
    assert report.markdown(again) == report.markdown(killer({}, records))


def test_a_report_before_the_killer_renders_without_the_fault_table() -> None:
    table = report.markdown(synthetic())
    assert "on 1 prefill + 1 decode workers" in table and "Each fault measured" not in table


@pytest.mark.parametrize(
    "run",
    [
        "reliability-soak.json",
        "reliability-soak-h200.json",
        "reliability-soak-h200-2.json",
        "reliability-soak-h200-3.json",
        "reliability-soak-h200-4.json",
    ],
)
def test_the_committed_soak_tables_are_the_ones_their_json_generates(run: str) -> None:
    """docs/reliability.md's soak sections: the CPU soak and each GPU run, one section each."""
    committed = report.load(DOCS / run)
    doc = (DOCS / "reliability.md").read_text()
    name, command = report.section_of(committed, Path("docs") / run)
    assert f"--report docs/{run}" in command
    assert docgen.section(doc, name) == report.markdown(committed)
    assert report.failures(committed) == committed.failures  # the verdict follows the data
    assert committed.passed, committed.failures


def test_report_mode_judges_the_data_not_what_it_claims(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    honest, lying = tmp_path / "honest.json", tmp_path / "lying.json"
    wrong = synthetic(counts={"ok": 90, "wrong": 1})
    honest.write_bytes(report.dump(msgspec.structs.replace(wrong, failures=report.failures(wrong))))
    lying.write_bytes(report.dump(wrong))  # says it passed
    assert soak.main(parser.parse_args(["--report", str(honest)])) == 1  # a failed run fails
    assert soak.main(parser.parse_args(["--report", str(lying)])) == 1
    clean = tmp_path / "clean.json"
    clean.write_bytes(report.dump(synthetic()))
    doc = tmp_path / "doc.md"
    doc.write_text("# Soak\n")
    assert soak.main(parser.parse_args(["--report", str(clean), "--doc", str(doc)])) == 0
    check = ["--report", str(clean), "--doc", str(doc), "--check"]
    assert soak.main(parser.parse_args(check)) == 0
    doc.write_text(doc.read_text().replace("**PASS**", "**FAIL**"))
    assert soak.main(parser.parse_args(check)) == 1
