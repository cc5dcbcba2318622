"""A worker's heartbeats: published every ``heartbeat_s`` on ``kvpush.v1.heartbeat.<role>.<id>``,
kept in the JetStream registry, and watched for stalls.

``Heartbeats.run`` publishes what ``make`` returns (the worker's current ``WorkerHeartbeat``,
stating its lease) every ``heartbeat_s``; the registry entry is written off the beat's path (a
slow JetStream must not make the heartbeats late; one write at a time, the newest beat wins).
Before each beat it measures the gap since the previous one, which is what the worker's peers
saw: a gap past ``lease_s`` means they counted the worker gone and released what it held, and
``on_stall(gap_s)`` runs (the worker aborts what it holds and takes a new epoch) before the
next beat goes out. ``stop`` ends the loop (bounded: with NATS gone a publish can sit in
nats-py's own timeouts) and deregisters.

Threading model: asyncio, on the worker's loop (one task for the loop, one for a registry
write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvpush.connector import Bus
from kvpush.schemas import subjects
from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.workers.registry import Registry

log = logging.getLogger(__name__)


class Heartbeats:
    """One worker's heartbeat loop; see the module docstring."""

    def __init__(
        self,
        bus: Bus,
        registry: Registry | None,
        make: Callable[[], WorkerHeartbeat],
        on_stall: Callable[[float], None],
        heartbeat_s: float,
        lease_s: float,
    ) -> None:
        self.bus, self.registry, self.make, self.on_stall = bus, registry, make, on_stall
        self.heartbeat_s, self.lease_s = heartbeat_s, lease_s
        self._task: asyncio.Task[None] | None = None
        self._put: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeats")

    async def beat(self) -> WorkerHeartbeat:
        """Publish one heartbeat now (and update the registry entry)."""
        beat = self.make()
        try:
            await self.bus.publish(subjects.heartbeat(beat.role, beat.worker_id), beat, span=False)
        except Exception as exc:
            log.warning("heartbeat failed: %r", exc)
        if self.registry is not None and (self._put is None or self._put.done()):
            self._put = asyncio.create_task(self._write(self.registry, beat))
        return beat

    async def stop(self, role: WorkerRole, worker_id: str) -> None:
        """End the loop and delete the registry entry (bounded: NATS may be gone)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self.heartbeat_s + 5.0)
        if self._put is not None:
            self._put.cancel()
        if self.registry is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.registry.delete(role, worker_id), 5.0)

    async def _run(self) -> None:
        last_beat = None
        while not self._closing:
            now = time.monotonic()
            try:  # a failing beat or stall handler must not end the beats: the worker would vanish
                if last_beat is not None and now - last_beat > self.lease_s:
                    self.on_stall(now - last_beat)
                last_beat = now
                await self.beat()
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self.heartbeat_s)

    @staticmethod
    async def _write(registry: Registry, beat: WorkerHeartbeat) -> None:
        try:
            await registry.put(beat)
        except Exception as exc:
            log.warning("registry update failed: %r", exc)
