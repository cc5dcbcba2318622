"""A worker's view of its peers of the other role: decode watches prefill workers, prefill watches
decode workers (``services.membership``, the view the gateway keeps too).

``PeerWatch`` seeds a ``Membership`` of one role from the JetStream registry (each entry aged by
its ``sent_at_ms``), subscribes to ``kvpush.v1.heartbeat.<role>.*`` and ticks it every quarter
lease, so a dead peer's ``left`` listeners run within its lease plus one tick; a tick that comes
late by half a lease or more (this worker's own loop stalled) judges no one, since the peers'
heartbeats of that time are still unread (one tick later, they are). The worker's
listeners release what the gone peer held: decode probes a dead prefill worker's side channels
(the connector fails what it was sending, and D computes those prompts itself), prefill aborts
what it was pushing into a dead decode worker (its source blocks are freed at once).

Threading model: asyncio, on the worker's loop (the heartbeat handler and the tick task).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from kvpush.connector import Bus
from kvpush.schemas import subjects
from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.membership import Member, Membership

MAX_PEERS = 4096


class PeerWatch:
    """One role's members as this worker sees them; see the module docstring."""

    def __init__(self, role: WorkerRole, lease_s: float) -> None:
        self.role = role
        self.view = Membership(lease_s, roles=frozenset({role}), max_members=MAX_PEERS)
        self._task: asyncio.Task[None] | None = None

    def on_join(self, call: Callable[[Member], None]) -> None:
        self.view.listeners.joined.append(call)

    def on_leave(self, call: Callable[[Member], None]) -> None:
        self.view.listeners.left.append(call)

    async def start(
        self, bus: Bus, seeds: Callable[[WorkerRole], Awaitable[list[WorkerHeartbeat]]]
    ) -> None:
        """Seed from the registry, then follow the heartbeats and tick."""
        now_ms = time.time() * 1000
        for beat in await seeds(self.role):
            self.view.observe(beat, age_s=max(0.0, now_ms - beat.sent_at_ms) / 1000)
        await bus.subscribe(subjects.heartbeats(self.role), self._on_heartbeat)
        self._task = asyncio.create_task(self._tick(), name=f"{self.role.value}-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def side_channels(self, worker_id: str) -> list[str] | None:
        """The peer's side channels, one per TP rank (a gone one's too, until forgotten)."""
        member = self.view.member(self.role, worker_id)
        if member is None:
            return None
        beat = member.heartbeat
        return list(beat.side_channels) or [beat.side_channel]

    async def _on_heartbeat(self, subject: str, message: object) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.view.observe(message)

    async def _tick(self) -> None:
        due = time.monotonic() + self.view.tick_s
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            late_s, due = now - due, now + self.view.tick_s
            if late_s > self.view.lease_s / 2:
                # this loop stalled (our own worker was stopped or blocked): the peers'
                # heartbeats that came meanwhile wait in the socket and are read before the
                # next tick judges anyone gone
                continue
            self.view.tick()
