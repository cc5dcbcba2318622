"""Membership: the one view of which workers are alive, shared by the gateway, prefill and decode.

Every worker publishes a ``WorkerHeartbeat`` on ``kvpush.v1.heartbeat.<role>.<id>`` every
``heartbeat_s``; a ``Membership`` fed with those heartbeats (``observe``) and ticked on a timer
(``tick``, every ``lease_s / 4``) holds one ``Member`` per (role, worker id). A member is
``ALIVE`` while its heartbeats arrive within ``lease_s`` (default 2 s: the gap of one lost
heartbeat after a kill is noticed in at most ``lease_s`` plus one tick), ``DRAINING`` while its
heartbeats say so (it finishes what it holds; it takes no new work), and ``GONE`` once its lease
expired or a heartbeat with a higher epoch (a restart) replaced it. Each transition calls the
listeners once: ``joined`` (a new member, or a new epoch), ``left`` (the member is gone; its
reason says why). Peers release what a gone member held from ``left``: the gateway fails or
moves the requests routed to it, decode fails what a dead P was sending it (its side channel is
suspected at once), prefill drops what it was pushing into a dead D. A heartbeat of an older
epoch than the member's is a late one of a previous incarnation and is ignored; a heartbeat of
the same epoch after ``GONE`` (a worker stopped past its lease, then resumed) does not bring the
member back: its work was released, so it must restart (a new epoch) to be used again.

Threading model: not thread-safe; one asyncio loop calls ``observe`` (the bus handler) and
``tick`` (the owner's timer task); listeners run inline and must not block.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 2.0


class MemberState(enum.Enum):
    ALIVE = "alive"
    DRAINING = "draining"
    GONE = "gone"


class LeaveReason(enum.Enum):
    EXPIRED = "expired"  # no heartbeat within the lease
    RESTARTED = "restarted"  # a heartbeat with a higher epoch came
    DEREGISTERED = "deregistered"  # the worker said it stopped


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
        self._clock = clock
        self._members: dict[tuple[WorkerRole, str], Member] = {}

    @property
    def tick_s(self) -> float:
        """How often the owner calls ``tick``: a quarter of the lease."""
        return self.lease_s / 4

    def observe(self, beat: WorkerHeartbeat) -> None:
        """A heartbeat arrived (the bus handler's call)."""
        if beat.role not in self.roles:
            return
        now = self._clock()
        key = (beat.role, beat.worker_id)
        member = self._members.get(key)
        if member is not None and beat.epoch < member.heartbeat.epoch:
            return  # a late heartbeat of a previous incarnation
        if member is not None and beat.epoch == member.heartbeat.epoch:
            if member.state is MemberState.GONE:
                return  # stopped past its lease: its work was released; it must restart
            member.heartbeat, member.seen_at = beat, now
            member.move(MemberState.DRAINING if beat.draining else MemberState.ALIVE)
            return
        if member is not None:  # a higher epoch: the old incarnation is gone
            self._leave(member, LeaveReason.RESTARTED)
        elif len(self._members) >= self.max_members:
            self._forget_gone()
            if len(self._members) >= self.max_members:
                self.rejected += 1
                return
        state = MemberState.DRAINING if beat.draining else MemberState.ALIVE
        member = self._members[key] = Member(beat, now, state)
        log.info("worker %s/%s joined (epoch %d)", beat.role.value, beat.worker_id, beat.epoch)
        for call in self.listeners.joined:
            call(member)

    def deregister(self, role: WorkerRole, worker_id: str) -> None:
        """The worker said it stopped (its registry key was deleted)."""
        member = self._members.get((role, worker_id))
        if member is not None:
            self._leave(member, LeaveReason.DEREGISTERED)

    def tick(self) -> None:
        """Expire the members whose lease ran out (the owner's timer calls it every ``tick_s``)."""
        now = self._clock()
        for member in list(self._members.values()):
            if member.state is not MemberState.GONE and now - member.seen_at > self.lease_s:
                self._leave(member, LeaveReason.EXPIRED)

    def _leave(self, member: Member, reason: LeaveReason) -> None:
        if not member.move(MemberState.GONE, reason):
            return
        role, worker_id = member.key
        log.warning("worker %s/%s left (%s)", role.value, worker_id, reason.value)
        for call in self.listeners.left:
            call(member)

    def _forget_gone(self) -> None:
        for key in [k for k, m in self._members.items() if m.state is MemberState.GONE]:
            del self._members[key]

    def members(self, role: WorkerRole, *, include_draining: bool = False) -> Iterator[Member]:
        """The live members of ``role`` (draining ones too if asked)."""
        wanted = (
            {MemberState.ALIVE, MemberState.DRAINING} if include_draining else {MemberState.ALIVE}
        )
        return (m for (r, _), m in self._members.items() if r is role and m.state in wanted)

    def epoch(self, role: WorkerRole, worker_id: str) -> int | None:
        """The live member's epoch, or None if it is gone or unknown."""
        member = self._members.get((role, worker_id))
        if member is None or member.state is MemberState.GONE:
            return None
        return member.heartbeat.epoch
