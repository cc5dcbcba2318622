"""The gateway's view of the live workers (``services.membership``): ``WorkerRegistry``, and
what the selection keeps of each (``WorkerState``: load, running, last pick).

``WorkerRegistry`` feeds the heartbeats seen on ``kvpush.v1.heartbeat.>`` to a ``Membership``
(docs/bus.md, membership): a worker is *alive* while its heartbeats keep arriving within its
lease (the one its heartbeats state, 1.5 s by default; ``--worker-lease-s`` for heartbeats that
state none); a look-up expires the members past their lease first. A *draining* worker stays
alive (its in-flight requests finish) but gets no new work and does not count for readiness. A
heartbeat with a new epoch means the worker restarted: requests routed to an older epoch are
lost there (``Gateway`` moves them to another decode worker, or fails them at once).

A worker's load is the heartbeat's ``in_flight`` (its ``queue_depth`` is part of it) plus the
requests this gateway sent to it since that heartbeat (so a burst between two heartbeats spreads
instead of piling onto one worker), less those of this gateway's requests the heartbeat still
counts that ended since (``ended``: a beat read between two requests does not count the
finished one for up to a heartbeat period).

``wait_for(role)`` returns once a worker of ``role`` has been seen since the registry started
(the gateway holds requests on it while workers start).

Bounds: at most ``max_workers`` members; heartbeats of further workers are dropped and counted.
Threading model: asyncio, on the gateway's loop only (the bus handler and request handlers);
no locks, no awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.gateway.route_choice import decode_order, prefill_order
from kvpush.services.membership import DEFAULT_LEASE_S, LeaveReason, Member, Membership

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    """A live member and what this gateway's selection keeps of it: its last heartbeat,
    corrected by what this gateway saw since (requests it sent, that started, that ended).
    Its load is counted when one of those changes (``recount``: the registry's ``observe``,
    ``mark``, ``started`` and ``ended`` call it), not when read: the router reads it of every
    worker per request, far more often than it changes."""

    member: Member
    sent_since_heartbeat: int = 0  # this gateway's requests sent to it since its heartbeat ...
    sent_running: int = 0  # ... of those, past their first token, or (on D) waiting for KV
    started_since_heartbeat: int = 0  # requests the heartbeat counts as queued, started since
    ended_since_heartbeat: int = 0  # this gateway's requests that heartbeat counts, ended since
    last_pick: float = 0.0
    beats: int = 0  # heartbeats of this member read (a Route keeps the count it was sent under)
    worker_id: str = field(init=False, repr=False, compare=False)  # the member's, read often
    gpu: str = field(init=False, repr=False, compare=False)  # its heartbeat's, read often
    counted: tuple[int, int] = field(init=False, repr=False, compare=False)  # load_running's

    def __post_init__(self) -> None:
        self.worker_id = self.member.heartbeat.worker_id
        self.gpu = self.member.heartbeat.gpu
        self.recount()

    @property
    def heartbeat(self) -> WorkerHeartbeat:
        return self.member.heartbeat

    def recount(self) -> None:
        """Count ``load_running`` anew from the heartbeat and what was seen since (after every
        change of either)."""
        hb = self.member.heartbeat
        # in_flight holds queue_depth: a queued request counts once; what ended since, at most
        # all of it
        left = hb.in_flight - self.ended_since_heartbeat
        load = (left if left > 0 else 0) + self.sent_since_heartbeat
        queued = hb.queue_depth - self.started_since_heartbeat
        waiting = (queued if queued > 0 else 0) + self.sent_since_heartbeat - self.sent_running
        self.counted = (load, load - waiting if waiting < load else 0)  # waiting: at most load

    @property
    def load(self) -> int:
        """Its heartbeat's ``in_flight``, less what ended since, plus what was sent since."""
        return self.counted[0]

    def load_running(self) -> tuple[int, int]:
        """``load`` and, inside it, the requests past their first token (on D: decoding, or
        waiting for their KV); the rest wait for this worker's own prefill: its heartbeat's
        ``queue_depth``, less those that started since, and those sent since not started.
        Both at once: the router asks this of every candidate per request."""
        return self.counted

    @property
    def waiting(self) -> int:
        """Requests waiting for this worker's own prefill (see ``load_running``)."""
        load, running = self.counted
        return load - running

    @property
    def running(self) -> int:
        """Requests past their first token (see ``load_running``)."""
        return self.counted[1]


class NoWorkerError(LookupError):
    """No live, non-draining worker of ``role``."""

    def __init__(self, role: WorkerRole) -> None:
        super().__init__(f"no {role.value} worker is available")
        self.role = role


@dataclass
class RegistryStats:
    expired: int = 0
    restarts: int = 0
    model_mismatch: set[str] = field(default_factory=set)


class WorkerRegistry:
    """Live workers by role; see the module docstring."""

    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        *,
        model: str | None = None,
        max_workers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.membership = Membership(lease_s, max_members=max_workers, clock=clock)
        self.membership.listeners.joined.append(self._joined)
        self.membership.listeners.left.append(self._left)
        self.model = model
        self.stats = RegistryStats()
        self._clock = clock
        # by role, then id (a role's look-ups hash its ids only: a str caches its hash)
        self._workers: dict[WorkerRole, dict[str, WorkerState]] = {role: {} for role in WorkerRole}
        # alive's answers by (role, include_draining), while the membership's changes are these
        self._alive: dict[tuple[WorkerRole, bool], list[WorkerState]] = {}
        self._alive_changes = -1
        self._seen = {role: asyncio.Event() for role in WorkerRole}  # set: a worker was seen

    async def on_message(self, subject: str, message: BusMessage) -> None:
        """Bus handler for ``kvpush.v1.heartbeat.>``."""
        if isinstance(message, WorkerHeartbeat):
            self.observe(message)

    def observe(self, hb: WorkerHeartbeat) -> None:
        member = self.membership.observe(hb)
        state = self._workers[hb.role].get(hb.worker_id)
        if member is not None and state is not None and state.member is member:
            state.sent_since_heartbeat = state.sent_running = 0
            state.started_since_heartbeat = state.ended_since_heartbeat = 0
            state.beats += 1
            state.gpu = hb.gpu
            state.recount()

    def _joined(self, member: Member) -> None:
        hb = member.heartbeat
        self._workers[hb.role][hb.worker_id] = WorkerState(member)
        self._alive_changes = -1
        self._seen[hb.role].set()
        if self.model and hb.model != self.model and hb.worker_id not in self.stats.model_mismatch:
            self.stats.model_mismatch.add(hb.worker_id)
            log.warning("worker %s serves %r, gateway %r", hb.worker_id, hb.model, self.model)

    def _left(self, member: Member) -> None:
        role, worker_id = member.key
        states = self._workers[role]
        state = states.get(worker_id)
        if state is not None and state.member is member:
            del states[worker_id]
        self._alive_changes = -1
        if member.left_because is LeaveReason.RESTARTED:
            self.stats.restarts += 1
        elif member.left_because is LeaveReason.EXPIRED:
            self.stats.expired += 1

    @property
    def rejected(self) -> int:
        """Heartbeats of workers past ``max_workers``, dropped."""
        return self.membership.rejected

    def seen(self, role: WorkerRole) -> bool:
        """Whether a worker of ``role`` has sent a heartbeat since the registry started."""
        return self._seen[role].is_set()

    async def wait_for(self, role: WorkerRole) -> None:
        """Return once a worker of ``role`` has been seen (at once if one has been)."""
        await self._seen[role].wait()

    async def back(self, role: WorkerRole, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait up to ``timeout_s`` for a live worker of ``role`` when one was seen before (a
        worker that missed its lease on a busy host rejoins within a few); False at once when
        none ever was."""
        deadline = time.monotonic() + timeout_s
        while self._seen[role].is_set() and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            if self.alive(role):
                return True
        return False

    def alive(
        self, role: WorkerRole, *, include_draining: bool = False, tick: bool = True
    ) -> list[WorkerState]:
        """The live workers of ``role`` (``tick``: expire those past their lease first). Kept
        until the membership changes (``Membership.changes``) or a worker joins or leaves: the
        router asks for them twice per request."""
        if tick:
            self.membership.tick()
        if self._alive_changes != self.membership.changes:
            self._alive_changes, self._alive = self.membership.changes, {}
        key = (role, include_draining)
        found = self._alive.get(key)
        if found is None:
            members = self.membership.members(role, include_draining=include_draining)
            states = self._workers[role]
            found = self._alive[key] = [states[m.heartbeat.worker_id] for m in members]
        return list(found)  # the caller's own

    def epoch(self, role: WorkerRole, worker_id: str) -> int | None:
        """The live worker's epoch, or None if it is gone (lease expired)."""
        self.membership.tick()
        return self.membership.epoch(role, worker_id)

    def pick(self, role: WorkerRole, *, count: bool = True, running: bool = False) -> WorkerState:
        """The least-loaded live worker of ``role``, marked picked (``mark``)."""
        candidates = self.alive(role)
        if not candidates:
            raise NoWorkerError(role)
        if role is WorkerRole.DECODE:
            best = min(candidates, key=decode_order)
        else:
            best = min(candidates, key=prefill_order)
        self.mark(best, count=count, running=running)
        return best

    def mark(self, state: WorkerState, *, count: bool = True, running: bool = False) -> None:
        """``state`` was picked now (and, with ``count``, sent a request; ``running``: one that
        does not wait for its prefill there: on D, a push or pull request)."""
        state.last_pick = self._clock()
        if count:
            state.sent_since_heartbeat += 1
            state.sent_running += running
            state.recount()

    def _state(self, role: WorkerRole, worker_id: str, epoch: int) -> WorkerState | None:
        state = self._workers[role].get(worker_id)
        return state if state is not None and state.heartbeat.epoch == epoch else None

    def started(self, role: WorkerRole, worker_id: str, epoch: int, beats: int) -> None:
        """A request sent to ``worker_id`` (of ``epoch``, after ``beats`` of its heartbeats) that
        waited for its prefill there got its first token: it runs now. No heartbeat read since
        it was sent: it is in ``sent_since_heartbeat``; else the latest one counts it."""
        state = self._state(role, worker_id, epoch)
        if state is None or beats < 0:
            return
        if state.beats == beats:
            state.sent_running = min(state.sent_since_heartbeat, state.sent_running + 1)
        else:
            state.started_since_heartbeat += 1
        state.recount()

    def ended(
        self, role: WorkerRole, worker_id: str, epoch: int, beats: int, *, running: bool
    ) -> None:
        """A request sent to ``worker_id`` (as in ``started``; ``running``: past its first token,
        or one that never waited there) ended: it leaves the worker's load now, not at the
        next heartbeat."""
        state = self._state(role, worker_id, epoch)
        if state is None or beats < 0:
            return
        if state.beats == beats:
            state.sent_since_heartbeat = max(0, state.sent_since_heartbeat - 1)
            if running:
                state.sent_running = max(0, state.sent_running - 1)
            state.sent_running = min(state.sent_running, state.sent_since_heartbeat)
        else:
            state.ended_since_heartbeat += 1
        state.recount()

    def counts(self) -> dict[str, int]:
        return {role.value: len(self.alive(role)) for role in WorkerRole}
