"""services/membership.py: joins, leases, restarts, draining, a stopped worker's return."""

from __future__ import annotations

import msgspec

from kvpush.schemas.messages import WorkerRole
from kvpush.services.membership import LeaveReason, Member, Membership, MemberState
from tests.unit.beats import Clock, beat

P, D = WorkerRole.PREFILL, WorkerRole.DECODE


def membership(lease_s: float = 2.0) -> tuple[Membership, Clock, list[tuple[str, Member]]]:
    clock = Clock()
    view = Membership(lease_s, clock=clock)
    events: list[tuple[str, Member]] = []
    view.listeners.joined.append(lambda m: events.append(("joined", m)))
    view.listeners.left.append(lambda m: events.append(("left", m)))
    return view, clock, events


def ids(view: Membership, role: WorkerRole, **kw: bool) -> list[str]:
    return [m.heartbeat.worker_id for m in view.members(role, **kw)]


def test_a_silent_worker_leaves_within_the_lease_plus_one_tick() -> None:
    view, clock, events = membership(lease_s=2.0)
    view.observe(beat(D, "d0"))
    assert [e for e, _ in events] == ["joined"] and ids(view, D) == ["d0"]
    clock.now += 2.0
    view.tick()
    assert ids(view, D) == ["d0"]  # exactly at the lease: still alive
    clock.now += view.tick_s
    view.tick()
    assert ids(view, D) == [] and view.epoch(D, "d0") is None
    assert events[-1][0] == "left" and events[-1][1].left_because is LeaveReason.EXPIRED
    view.tick()
    assert len(events) == 2  # left once


def test_heartbeats_keep_a_worker_alive() -> None:
    view, clock, events = membership(lease_s=2.0)
    for _ in range(10):
        view.observe(beat(P, "p0"))
        clock.now += 1.5
        view.tick()
    assert ids(view, P) == ["p0"] and len(events) == 1


def test_a_restart_is_a_leave_then_a_join_and_late_beats_are_ignored() -> None:
    view, _, events = membership()
    view.observe(beat(D, "d0", epoch=1))
    view.observe(beat(D, "d0", epoch=2))
    assert [(e, m.heartbeat.epoch) for e, m in events] == [
        ("joined", 1),
        ("left", 1),
        ("joined", 2),
    ]
    assert events[1][1].left_because is LeaveReason.RESTARTED
    view.observe(beat(D, "d0", epoch=1))  # late, from the old incarnation
    assert view.epoch(D, "d0") == 2 and len(events) == 3


def test_a_worker_stopped_past_its_lease_leaves_then_joins_again_as_a_new_member() -> None:
    view, clock, events = membership(lease_s=2.0)
    view.observe(beat(P, "p0", epoch=7, sent_at_ms=50_000))
    clock.now += 3.0
    # SIGCONT before any tick: its next beat is sent 3 s after the last, it left all the same
    view.observe(beat(P, "p0", epoch=7, sent_at_ms=53_000))
    assert [e for e, _ in events] == ["joined", "left", "joined"] and view.rejoined == 1
    assert events[1][1] is not events[2][1] and ids(view, P) == ["p0"]


def test_beats_sent_in_time_but_read_late_keep_the_member() -> None:
    """This side's loop stalled 3 s: the beats the worker sent meanwhile, every 0.5 s by its own
    clock, are read at once after the stall, past the lease by this side's: it never left."""
    view, clock, events = membership(lease_s=2.0)
    view.observe(beat(D, "d0", sent_at_ms=50_000))
    clock.now += 3.0
    for sent in (50_500, 51_000, 51_500, 52_000, 52_500, 53_000):
        view.observe(beat(D, "d0", sent_at_ms=sent))
    assert [e for e, _ in events] == ["joined"] and ids(view, D) == ["d0"]
    clock.now += 2.5  # then silent past the lease: gone, as ever
    view.tick()
    assert [e for e, _ in events] == ["joined", "left"]


def test_a_worker_states_its_own_lease_and_registry_entries_are_aged() -> None:
    view, clock, events = membership(lease_s=2.0)
    slow = msgspec.structs.replace(beat(P, "p0"), lease_ms=10_000)
    view.observe(slow)
    clock.now += 5.0
    view.tick()
    assert ids(view, P) == ["p0"]  # its own lease (10 s), not the view's default (2 s)
    view.observe(beat(D, "d0"), age_s=1.5)  # from the registry, sent 1.5 s ago
    clock.now += 0.6
    view.tick()
    assert ids(view, D) == [] and events[-1][1].left_because is LeaveReason.EXPIRED


def test_draining_members_are_alive_but_not_offered_for_new_work() -> None:
    view, _, events = membership()
    view.observe(beat(D, "d0"))
    view.observe(beat(D, "d0", draining=True))
    assert ids(view, D) == [] and ids(view, D, include_draining=True) == ["d0"]
    assert view.epoch(D, "d0") == 1 and len(events) == 1
    view.observe(beat(D, "d0"))  # back to work
    assert ids(view, D) == ["d0"]


def test_roles_filter_and_the_member_bound() -> None:
    clock = Clock()
    view = Membership(2.0, roles=frozenset({P}), max_members=2, clock=clock)
    view.observe(beat(D, "d0"))
    assert ids(view, D) == []  # not a role this view keeps
    for name in ("p0", "p1", "p2"):
        view.observe(beat(P, name))
    assert ids(view, P) == ["p0", "p1"] and view.rejected == 1
    clock.now += 3.0
    view.tick()
    view.observe(beat(P, "p2"))  # gone members make room
    assert ids(view, P) == ["p2"]


def test_member_moves_only_along_legal_transitions() -> None:
    member = Member(beat(D, "d0"), 0.0)
    assert member.move(MemberState.GONE, LeaveReason.EXPIRED)
    assert not member.move(MemberState.ALIVE) and member.state is MemberState.GONE


def test_a_shorter_lease_stated_later_is_read_by_the_next_tick() -> None:
    # a tick reads no member before the earliest lease can end: a beat that shortens its lease
    # moves that end, and the silent member leaves on time
    view, clock, events = membership(lease_s=2.0)
    view.observe(msgspec.structs.replace(beat(P, "p0"), lease_ms=10_000))
    clock.now += 1.0
    view.tick()  # no lease ends before 11.0
    view.observe(msgspec.structs.replace(beat(P, "p0"), lease_ms=500))
    clock.now += 0.4
    view.tick()
    assert ids(view, P) == ["p0"]
    clock.now += 0.2
    view.tick()
    assert ids(view, P) == [] and events[-1][1].left_because is LeaveReason.EXPIRED
