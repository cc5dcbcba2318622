"""The soak's per-fault measurements on synthetic times: recovery, summaries, detection."""

from __future__ import annotations

import pytest

from kvpush.benchmarks.soak.measure import (
    FaultRecord,
    Throughput,
    detection_failures,
    recovery_time,
    summarize,
)


def steady(rate: float, start: float, end: float, into: Throughput | None = None) -> Throughput:
    """Completions at ``rate`` per second over ``[start, end)``."""
    found = into or Throughput()
    n = round((end - start) * rate)
    for i in range(n):
        found.add(start + (i + 0.5) / rate)
    return found


def test_the_throughput_counts_and_rates_half_open_intervals() -> None:
    flow = steady(4.0, 0.0, 10.0)
    assert flow.count(0.0, 10.0) == 40 and flow.rate(0.0, 5.0) == pytest.approx(4.0)
    assert flow.rate(3.0, 3.0) == 0.0


def test_a_rate_that_never_dipped_recovered_at_once() -> None:
    flow = steady(4.0, 0.0, 60.0)
    assert recovery_time(flow, 20.0, 60.0, 4.0, 10.0) == 0.0


def test_recovery_is_where_every_later_window_holds_ninety_percent() -> None:
    flow = steady(4.0, 0.0, 20.0)
    steady(1.0, 20.0, 35.0, flow)  # the dip: 15 s at a quarter
    steady(4.0, 35.0, 70.0, flow)
    back = recovery_time(flow, 20.0, 70.0, 4.0, 10.0)
    assert back is not None and 13.0 <= back <= 15.0  # a window holds 90% once 1 s of dip is left


def test_a_window_that_ends_below_the_floor_did_not_recover() -> None:
    flow = steady(4.0, 0.0, 20.0)
    steady(4.0, 20.0, 40.0, flow)
    steady(1.0, 40.0, 55.0, flow)  # dips again before the window ends
    assert recovery_time(flow, 20.0, 55.0, 4.0, 10.0) is None


def test_a_fault_window_shorter_than_a_rate_window_is_not_rated() -> None:
    flow = steady(4.0, 0.0, 30.0)
    assert recovery_time(flow, 20.0, 25.0, 4.0, 10.0) is None


def record(kind: str, victim: str = "soak-d0", **changes: object) -> FaultRecord:
    base: dict[str, object] = dict(
        kind=kind, victim=victim, at_s=10.0, in_flight=4, window_s=40.0, baseline_rate=4.0,
        fault_rate=3.0, detect_s=1.5, rejoin_s=20.0, back_s=21.0, recovery_s=12.0,
        migrations={"decode": 2},
    )  # fmt: skip
    base.update(changes)
    return FaultRecord(**base)  # type: ignore[arg-type]


def test_faults_are_summarized_per_kind() -> None:
    records = [
        record("kill_decode"),
        record("kill_decode", detect_s=1.9, back_s=None, recovery_s=None, migrations={"bus": 1}),
        record("restart_nats", "", detect_s=None, rejoin_s=None, back_s=None, migrations={}),
    ]
    kill, nats = summarize(records)
    assert (kill.kind, kill.count, kill.detect_max_s, kill.undetected) == ("kill_decode", 2, 1.9, 0)
    assert kill.not_served_again == 1 and kill.not_recovered == 1
    assert kill.migrations == {"bus": 1, "decode": 2} and kill.rate_share == 0.75
    assert nats.undetected == 0 and nats.not_served_again == 0  # no victim to notice
    assert nats.detect_median_s is None


def test_a_kill_noticed_late_or_never_fails_and_a_nats_restart_is_not_judged() -> None:
    records = [
        record("kill_prefill", "soak-p1", detect_s=2.4),
        record("stop_decode", detect_s=None),
        record("stop_prefill", "soak-p0", detect_s=1.9),
        record("restart_nats", "", detect_s=None),
    ]
    found = detection_failures(records, 2.0)
    assert len(found) == 2
    assert "soak-p1" in found[0] and "2.40 s" in found[0] and "never" in found[1]


def test_the_profile_counts_each_second_of_a_window() -> None:
    flow = steady(2.0, 0.0, 4.0)
    assert flow.profile(0.0, 4.0) == [2, 2, 2, 2]
    assert flow.profile(1.0, 3.5) == [2, 2]  # whole seconds only
