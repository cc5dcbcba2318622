"""The soak's books on synthetic data: leaks per interval and kind, counts, the verdict."""

from __future__ import annotations

import pytest

from kvpush.benchmarks.soak.accounting import (
    IdleSample,
    Tally,
    interval_leaks,
    leak_failures,
    make_interval,
    summarize_leaks,
)
from kvpush.benchmarks.soak.checks import LOAD, Category, Delivery, Judgement

TOTAL = 100


def idle(worker: str, free: int = TOTAL, epoch: int = 1, *, stable: bool = True,
         in_flight: int = 0) -> IdleSample:  # fmt: skip
    return IdleSample(worker, epoch, free, TOTAL, in_flight, stable, 1.0)


def test_a_surviving_worker_leaks_what_its_idle_count_lost() -> None:
    leaks = interval_leaks([idle("p"), idle("d")], [idle("p"), idle("d", 97)])
    assert [(w.worker, w.restarted, w.leaked) for w in leaks] == [
        ("p", False, 0),
        ("d", False, 3),
    ]


def test_a_restarted_worker_is_measured_by_its_new_incarnation_only() -> None:
    # p was short 5 blocks before its kill: that is the previous interval's finding, not this
    # one's; the new incarnation starts with every block free and must be idle at TOTAL again.
    before = [idle("p", 95), idle("d")]
    assert interval_leaks(before, [idle("p", TOTAL, 2), idle("d")])[0].leaked == 0
    leak = interval_leaks(before, [idle("p", 98, 2), idle("d")])[0]
    assert leak.restarted and leak.leaked == 2


def test_a_worker_missing_after_the_interval_is_an_error() -> None:
    with pytest.raises(ValueError):
        interval_leaks([idle("p")], [idle("d")])


def test_leaks_are_summed_and_maxed_per_kind_survivors_and_restarts_apart() -> None:
    both = [idle("p"), idle("d")]
    intervals = [
        make_interval(LOAD, 0, 0, both, both),
        make_interval("kill_prefill", 30, 3, both, [idle("p", 99, 2), idle("d", 98)]),
        make_interval(
            "kill_prefill",
            90,
            4,
            [idle("p", epoch=2), idle("d", 98)],
            [idle("p", epoch=3), idle("d", 97)],
        ),
    ]
    load, kill = summarize_leaks(intervals)
    assert (load.kind, load.leaked_sum, load.leaked_max) == (LOAD, 0, 0)
    assert kill.intervals == 2 and kill.in_flight == 7
    assert kill.survivors == {"d": 2} and kill.restarted == {"p": 2}
    assert (kill.leaked_sum, kill.leaked_max) == (3, 2)
    assert (kill.restarted_leaked_sum, kill.restarted_leaked_max) == (1, 1)
    found = leak_failures(intervals)
    assert len(found) == 3 and any("restarted incarnation of p" in f for f in found)


def test_blocks_that_come_back_late_do_not_offset_a_leak_in_the_sum() -> None:
    intervals = [
        make_interval(LOAD, 0, 0, [idle("d")], [idle("d", 96)]),
        make_interval(LOAD, 40, 0, [idle("d", 96)], [idle("d")]),
    ]
    (load,) = summarize_leaks(intervals)
    assert load.leaked_sum == 4 and leak_failures(intervals)


def test_a_worker_that_never_went_idle_fails_the_run() -> None:
    stuck = idle("d", 90, stable=False, in_flight=1)
    intervals = [make_interval("stop_decode", 10, 2, [idle("d")], [stuck])]
    found = leak_failures(intervals)
    assert any("never went idle" in f for f in found)


def test_a_clean_run_has_no_leak_failures() -> None:
    intervals = [make_interval("burst", 10, 4, [idle("p"), idle("d")], [idle("p"), idle("d")])]
    assert leak_failures(intervals) == []


def test_the_tally_counts_paths_windows_and_the_success_share() -> None:
    tally = Tally()
    tally.add(Judgement(Category.OK, "push/received"), Delivery.JSON, LOAD)
    tally.add(Judgement(Category.OK, "push/received"), Delivery.STREAM, LOAD)
    tally.add(Judgement(Category.OK, "local"), Delivery.JSON, "kill_prefill")
    tally.add(Judgement(Category.ABORTED, "pull/received"), Delivery.ABORT, LOAD)
    expected = Judgement(Category.EXPECTED_ERROR, "unknown", "503 x: no prefill")
    tally.add(expected, Delivery.JSON, "kill_prefill")
    tally.add(Judgement(Category.UNEXPECTED, "unknown", "500 boom"), Delivery.JSON, LOAD)
    tally.add(Judgement(Category.WRONG, "pull/fallback", "ids"), Delivery.STREAM, LOAD)
    tally.add(Judgement(Category.OK, "pull/cached"), Delivery.JSON, LOAD)
    assert tally.sent == 8
    assert tally.success_share() == pytest.approx(4 / 7)  # the client's abort is left out
    paths = {p.path: p for p in tally.paths()}
    assert paths["pull/cached"].json == 1  # D's prefix cache held it: counted, not dropped
    assert (paths["push/received"].json, paths["push/received"].stream) == (1, 1)
    assert paths["pull/received"].aborted == 1 and paths["pull/fallback"].wrong == 1
    assert "unknown" not in paths  # errors are no checked answers
    errors = tally.errors()
    assert [(e.window, e.expected) for e in errors] == [(LOAD, False), ("kill_prefill", True)]
    assert tally.windows()["kill_prefill"] == {"expected_error": 1, "ok": 1}
    assert len(tally.examples) == 2
