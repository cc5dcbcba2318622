"""A worker's prefix-cache reports on the bus: ``CacheEvents`` on
``kvpush.v1.cache.<role>.<worker>`` from its ``CacheEventReader`` (cache_events.py), and the
snapshots ``CacheSync`` asks for.

``CachePublisher`` waits for the reader's changes, takes what collected and publishes it, then
sleeps ``interval_s`` (50 ms) so changes coalesce: at most one publish round per interval, each
message at most ``MAX_CACHE_HASHES`` hashes (a larger round is split). ``seq`` counts this
worker's messages from 0 per epoch, so a gateway sees a lost one. The first round, a
``CacheSync`` naming this worker (or none) and a new epoch (the worker rejoined) make the next
round a snapshot: every hash the mirror holds, the first message ``cleared``, the last one
``last``; changes before it are part of it, changes after it follow with higher ``seq``. So do
pending changes past the mirror's capacity (``PendingChanges.overflowed``: publishing stalled).
A reader whose thread died reported the cache cleared: that is published, then nothing more.

Threading model: one task on the worker's asyncio loop publishes; ``wake`` is safe to call from
the reader's thread (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from nats.aio.subscription import Subscription

from kvpush.connector import Bus
from kvpush.schemas import subjects
from kvpush.schemas.messages import MAX_CACHE_HASHES, CacheEvents, CacheSync, WorkerRole
from kvpush.services.workers.cache_events import CacheEventReader
from kvpush.services.workers.events_socket import remove_stale_sockets

log = logging.getLogger(__name__)

INTERVAL_S = 0.05  # at most one publish round per this long


def chunks(stored: list[int], removed: list[int], size: int) -> list[tuple[list[int], list[int]]]:
    """(stored, removed) pairs of at most ``size`` hashes together, removed first; at least one
    pair (maybe empty)."""
    out: list[tuple[list[int], list[int]]] = []
    for start in range(0, len(removed), size):
        out.append(([], removed[start : start + size]))
    if out and len(out[-1][1]) < size:  # top up the last removed chunk with stored hashes
        room = size - len(out[-1][1])
        out[-1] = (stored[:room], out[-1][1])
        stored = stored[room:]
    for start in range(0, len(stored), size):
        out.append((stored[start : start + size], []))
    return out or [([], [])]


class CachePublisher:
    """Publishes one worker's cache events; see the module docstring."""

    def __init__(
        self,
        bus: Bus,
        reader: CacheEventReader,
        role: WorkerRole,
        worker_id: str,
        epoch: Callable[[], int],
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.bus, self.reader = bus, reader
        self.worker_id = worker_id
        self.subject = subjects.cache_events(role, worker_id)
        self.published = 0  # messages
        self._epoch_of = epoch
        self._epoch = epoch()
        self._seq = 0
        self._interval_s = interval_s
        self._wake = asyncio.Event()
        self._snapshot_wanted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._sync: Subscription | None = None

    @classmethod
    async def open(
        cls,
        bus: Bus,
        role: WorkerRole,
        worker_id: str,
        endpoint: str,
        total_blocks: int,
        epoch: Callable[[], int],
    ) -> CachePublisher:
        """Read the engine's KV events at ``endpoint`` into a mirror of at most
        ``total_blocks`` (the pool's) and publish them (``stop`` ends both). First the socket
        files killed processes of this worker left beside ``endpoint`` go."""
        for stale in remove_stale_sockets(endpoint):
            log.info("removed %s: %s's KV events socket, its process gone", stale, worker_id)
        reader = CacheEventReader(endpoint, total_blocks)
        publisher = cls(bus, reader, role, worker_id, epoch)
        reader.on_ready = publisher.wake  # a no-op until the publisher starts
        reader.start()  # first: a refused endpoint (zmq.ZMQError) leaves nothing running
        try:
            await publisher.start()
        except BaseException:
            await publisher.stop()
            raise
        return publisher

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sync = await self.bus.subscribe(subjects.cache_sync(), self.on_sync, span=False)
        self._snapshot_wanted = True  # a (re)started worker's cache starts empty: say so
        self._wake.set()
        self._task = asyncio.create_task(self._run(), name="kvpush-cache-events")

    async def stop(self) -> None:
        """Stop publishing and the reader (its thread is joined on one of the loop's)."""
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.unsubscribe()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self.reader.stop)

    def wake(self) -> None:
        """The reader has changes (any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def on_sync(self, subject: str, message: object) -> None:
        if isinstance(message, CacheSync) and (
            not message.workers or self.worker_id in message.workers
        ):
            self._snapshot_wanted = True
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.publish_round()
            except Exception:  # the bus is down or closing: the next round (or a sync) heals
                log.warning("publishing cache events failed", exc_info=True)
            await asyncio.sleep(self._interval_s)

    async def publish_round(self) -> None:
        """Publish what collected: a snapshot when one is due, else the changes."""
        epoch = self._epoch_of()
        if epoch != self._epoch:  # rejoined: gateways dropped what we had, send it all
            self._epoch, self._seq, self._snapshot_wanted = epoch, 0, True
        if self._snapshot_wanted:
            self._snapshot_wanted = False
            await self._publish_snapshot()
            return
        changes = self.reader.take()
        if changes.overflowed:  # more than the mirror holds: the snapshot is smaller
            await self._publish_snapshot()
            return
        if not changes:
            return
        stored, removed = changes.split()
        for index, (part_stored, part_removed) in enumerate(
            chunks(stored, removed, MAX_CACHE_HASHES)
        ):
            cleared = changes.cleared and index == 0
            block_size = self.reader.mirror.block_size
            await self._publish(part_stored, part_removed, block_size, cleared, False, True)

    async def _publish_snapshot(self) -> None:
        held, block_size = self.reader.snapshot()
        parts = chunks(held, [], MAX_CACHE_HASHES)
        for index, (stored, _) in enumerate(parts):
            last = index == len(parts) - 1
            await self._publish(stored, [], block_size, index == 0, True, last)

    async def _publish(
        self,
        stored: list[int],
        removed: list[int],
        block_size: int,
        cleared: bool,
        snapshot: bool,
        last: bool,
    ) -> None:
        message = CacheEvents(
            worker_id=self.worker_id,
            epoch=self._epoch,
            seq=self._seq,
            block_size=block_size,
            stored=stored,
            removed=removed,
            cleared=cleared,
            snapshot=snapshot,
            last=last,
        )
        self._seq += 1
        await self.bus.publish(self.subject, message, span=False)
        self.published += 1
