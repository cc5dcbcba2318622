"""Membership: the one view of which workers are alive, shared by the gateway, prefill and decode.

Every worker publishes a ``WorkerHeartbeat`` on ``kvpush.v1.heartbeat.<role>.<id>`` every
``--heartbeat-s`` (0.5 s) and states its lease in it (``lease_ms``: ``--lease-s``, 1.5 s). A
``Membership`` fed with those heartbeats (``observe``; at start also with the JetStream
registry's last ones, aged by their ``sent_at_ms``) and ticked (``tick``: a worker's view on a
timer, every quarter of its default lease; the gateway's at each look-up, and its requests look
every half second) holds one ``Member`` per (role, worker id). A member is ``ALIVE``
while its heartbeats arrive within its lease, ``DRAINING`` while its heartbeats say so (it
finishes what it holds; it takes no new work), and ``GONE`` once its lease ran out or a heartbeat
with a higher epoch (a restart) replaced it (a worker that stops drains first, then falls
silent). A kill is noticed
within the lease plus one tick. Each transition calls the listeners once: ``joined`` (a new
member, a new epoch, or a gone one heard again), ``left`` (the member is gone; its reason says
why). Peers release what a gone member held from ``left``: the gateway moves or fails the
requests routed to it, decode fails what a dead P was sending it (its side channel is probed at
once), prefill aborts what it was pushing into a dead D. A heartbeat of an older epoch than the
member's is a late one of a previous incarnation and is ignored. A heartbeat that arrives past
the lease but was sent within it of the member's last one (by the sender's ``sent_at_ms``: one
clock) was read late, because this side's loop stalled: the member stays (a worker stopped
meanwhile sends its next beat past its lease). A heartbeat of the same epoch
after ``GONE`` (a worker stopped past its lease, or cut off from the bus, then back) joins
again as a new member: what it held was released on the peers, and the worker itself aborts
what it held when it finds its own heartbeats stalled past its lease (``worker.py``).

Threading model: not thread-safe; one asyncio loop calls ``observe`` (the bus handler) and
``tick`` (the owner's timer task); listeners run inline and must not block.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 1.5  # three heartbeats: a kill is noticed within 2 s
TICK_SLACK_S = 1e-3  # a tick reads the leases from this long before the earliest one ends


class MemberState(enum.Enum):
    ALIVE = "alive"
    DRAINING = "draining"
    GONE = "gone"


class LeaveReason(enum.Enum):
    EXPIRED = "expired"  # no heartbeat within the lease
    RESTARTED = "restarted"  # a heartbeat with a higher epoch came


# legal transitions: GONE is final for an epoch
_NEXT: dict[MemberState, frozenset[MemberState]] = {
    MemberState.ALIVE: frozenset({MemberState.DRAINING, MemberState.GONE}),
    MemberState.DRAINING: frozenset({MemberState.ALIVE, MemberState.GONE}),
    MemberState.GONE: frozenset(),
}


@dataclass
class Member:
    heartbeat: WorkerHeartbeat
    seen_at: float  # clock time of the last heartbeat
    state: MemberState = MemberState.ALIVE
    left_because: LeaveReason | None = None

    def lease_s(self, default: float) -> float:
        """The lease the member's heartbeats state, or ``default`` when they state none."""
        return self.heartbeat.lease_ms / 1000 if self.heartbeat.lease_ms else default

    @property
    def why(self) -> str:
        """Why it left ("" while it is a member)."""
        return self.left_because.value if self.left_because is not None else ""

    @property
    def key(self) -> tuple[WorkerRole, str]:
        return self.heartbeat.role, self.heartbeat.worker_id

    def move(self, to: MemberState, reason: LeaveReason | None = None) -> bool:
        """The one transition method: False (and no change) for a move that is not legal."""
        if to is self.state:
            return False
        if to not in _NEXT[self.state]:
            return False
        self.state = to
        if to is MemberState.GONE:
            self.left_because = reason
        return True


@dataclass
class Listeners:
    joined: list[Callable[[Member], None]] = field(default_factory=list)
    left: list[Callable[[Member], None]] = field(default_factory=list)


def _sent_in_time(member: Member, beat: WorkerHeartbeat, lease_s: float) -> bool:
    """Whether ``beat`` was sent within the member's lease of its last one, by the sender's own
    clock (one clock: no skew): then it came late because this side read it late (its loop
    stalled), and the member never left."""
    last = member.heartbeat
    if beat.epoch != last.epoch or not beat.sent_at_ms or not last.sent_at_ms:
        return False
    return 0 <= beat.sent_at_ms - last.sent_at_ms <= lease_s * 1000


class Membership:
    """Who is alive, by role; see the module docstring."""

    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        roles: frozenset[WorkerRole] = frozenset(WorkerRole),
        max_members: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {lease_s}")
        self.lease_s, self.roles, self.max_members = lease_s, roles, max_members
        self.listeners = Listeners()
        self.rejected = 0  # heartbeats of members past max_members
        self.rejoined = 0  # gone members heard again with the same epoch
        self.changes = 0  # counts what changes the answer of ``members``: a join, a state's move
        self._clock = clock
        self._members: dict[tuple[WorkerRole, str], Member] = {}
        self._lease_ends = math.inf  # no member's lease ends before it (a lower bound)

    @property
    def tick_s(self) -> float:
        """How often the owner calls ``tick``: a quarter of the lease."""
        return self.lease_s / 4

    def observe(self, beat: WorkerHeartbeat, age_s: float = 0.0) -> Member | None:
        """A heartbeat arrived (the bus handler's call), sent ``age_s`` ago (a registry entry's
        age); the member it keeps alive, or None (ignored)."""
        if beat.role not in self.roles:
            return None
        now = self._clock() - max(0.0, age_s)
        key = (beat.role, beat.worker_id)
        member = self._members.get(key)
        if member is not None and beat.epoch < member.heartbeat.epoch:
            return None  # a late heartbeat of a previous incarnation
        if member is not None and self._silent_past_lease(member, beat, now):
            self._leave(member, LeaveReason.EXPIRED)  # before this beat (no tick in between)
        if member is not None and beat.epoch == member.heartbeat.epoch:
            if member.state is not MemberState.GONE:
                member.heartbeat, member.seen_at = beat, max(member.seen_at, now)
                self._lease_may_end(member)
                if member.move(MemberState.DRAINING if beat.draining else MemberState.ALIVE):
                    self.changes += 1
                return member
            self.rejoined += 1  # stopped past its lease, or cut off: what it held was released
        elif member is not None:  # a higher epoch: the old incarnation is gone
            self._leave(member, LeaveReason.RESTARTED)
        elif len(self._members) >= self.max_members:
            self.tick()
            self._forget_gone()
            if len(self._members) >= self.max_members:
                self.rejected += 1
                return None
        state = MemberState.DRAINING if beat.draining else MemberState.ALIVE
        member = self._members[key] = Member(beat, now, state)
        self.changes += 1
        self._lease_may_end(member)
        log.info("worker %s/%s joined (epoch %d)", beat.role.value, beat.worker_id, beat.epoch)
        for call in self.listeners.joined:
            call(member)
        return member

    def _silent_past_lease(self, member: Member, beat: WorkerHeartbeat, now: float) -> bool:
        """The member's lease ran out before ``beat`` came, and ``beat`` was not sent in time
        (``_sent_in_time``: then this side only read it late)."""
        lease_s = member.lease_s(self.lease_s)
        return now - member.seen_at > lease_s and not _sent_in_time(member, beat, lease_s)

    def tick(self) -> None:
        """Expire the members whose lease ran out (the owner's timer calls it every ``tick_s``).
        Before the earliest lease can end (less ``TICK_SLACK_S``: far above the rounding of
        the clock's sums) none did, and the members are not read: the gateway ticks at every
        look-up."""
        now, default = self._clock(), self.lease_s
        if now < self._lease_ends - TICK_SLACK_S:
            return
        for member in list(self._members.values()):
            if member.state is MemberState.GONE:
                continue  # left already: no lease to read
            if now - member.seen_at > member.lease_s(default):
                self._leave(member, LeaveReason.EXPIRED)
        live = (m for m in self._members.values() if m.state is not MemberState.GONE)
        self._lease_ends = min((m.seen_at + m.lease_s(default) for m in live), default=math.inf)

    def _lease_may_end(self, member: Member) -> None:
        """``member``'s heartbeat (or its time) changed: its lease may end before the others'."""
        self._lease_ends = min(self._lease_ends, member.seen_at + member.lease_s(self.lease_s))

    def member(self, role: WorkerRole, worker_id: str) -> Member | None:
        """The member of that id (gone ones too, until forgotten)."""
        return self._members.get((role, worker_id))

    def _leave(self, member: Member, reason: LeaveReason) -> None:
        if not member.move(MemberState.GONE, reason):
            return
        self.changes += 1
        role, worker_id = member.key
        log.warning("worker %s/%s left (%s)", role.value, worker_id, reason.value)
        for call in self.listeners.left:
            call(member)

    def _forget_gone(self) -> None:
        for key in [k for k, m in self._members.items() if m.state is MemberState.GONE]:
            del self._members[key]

    def members(self, role: WorkerRole, *, include_draining: bool = False) -> Iterator[Member]:
        """The live members of ``role`` (draining ones too if asked)."""
        members = self._members.items()
        if include_draining:
            return (m for (r, _), m in members if r is role and m.state is not MemberState.GONE)
        return (m for (r, _), m in members if r is role and m.state is MemberState.ALIVE)

    def epoch(self, role: WorkerRole, worker_id: str) -> int | None:
        """The live member's epoch, or None if it is gone or unknown."""
        member = self._members.get((role, worker_id))
        if member is None or member.state is MemberState.GONE:
            return None
        return member.heartbeat.epoch
