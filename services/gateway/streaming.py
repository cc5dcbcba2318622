"""Token streams: one subscription on ``kvpush.v1.tokens.<gateway_id>``, one queue per request.

``TokenStreams`` subscribes once for the gateway and hands each TokenChunk to the
``RequestStream`` registered under its ``request_id`` (and matching ``transfer_id``). Chunks
are delivered in ``seq`` order starting at 0: an early chunk waits (held) until the gap before
it is filled; a chunk whose ``seq`` was already delivered is a duplicate and is dropped. The
chunk with a ``finish_reason`` (or an ``error``) ends the stream and unregisters it, so later
chunks of that request count as unknown. Chunks for request ids nobody waits for (finished,
aborted, another gateway's bug) are counted in ``stats.unknown`` and dropped.

Bounds: each stream holds at most ``max_chunks`` chunks (ready + held). Past that the client
is not reading fast enough (or a gap never closes): the stream fails with ``StreamFailed``,
which the gateway answers as an error and an abort. NATS's own pending limits bound the
subscription.

Threading model: asyncio, on the gateway's loop. The bus delivers chunks one at a time on the
subscription's task (``_on_message`` never awaits); each request handler awaits its own
stream's ``next()``.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from kvpush.connector import Bus
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import TokenChunk


class StreamFailed(RuntimeError):
    """The stream can not continue (buffer overflow); the message says why."""


@dataclass
class StreamStats:
    chunks: int = 0  # delivered to a stream
    unknown: int = 0  # no stream waits for this request id / transfer id
    duplicates: int = 0  # seq already delivered
    overflows: int = 0  # streams failed because their buffer was full
    reordered: int = 0  # chunks that arrived before an earlier seq


class RequestStream:
    """The chunks of one request, in ``seq`` order; see the module docstring."""

    def __init__(self, request_id: str, transfer_id: str, max_chunks: int) -> None:
        self.request_id = request_id
        self.transfer_id = transfer_id
        self.max_chunks = max_chunks
        self.finished = False  # the final chunk was queued
        self.failure: str | None = None
        self._next_seq = 0
        self._ready: collections.deque[TokenChunk] = collections.deque()
        self._held: dict[int, TokenChunk] = {}
        self._wake = asyncio.Event()

    def offer(self, chunk: TokenChunk, stats: StreamStats) -> None:
        """Take one chunk from the bus (never blocks)."""
        if self.finished or self.failure is not None:
            stats.unknown += 1
            return
        if chunk.seq < self._next_seq or chunk.seq in self._held:
            stats.duplicates += 1
            return
        if len(self._ready) + len(self._held) >= self.max_chunks:
            stats.overflows += 1
            self.failure = f"more than {self.max_chunks} chunks buffered for a slow client"
            self._wake.set()
            return
        stats.chunks += 1
        if chunk.seq != self._next_seq:
            stats.reordered += 1
            self._held[chunk.seq] = chunk
            return
        self._push(chunk)
        while not self.finished and self._next_seq in self._held:
            self._push(self._held.pop(self._next_seq))
        self._wake.set()

    def _push(self, chunk: TokenChunk) -> None:
        self._ready.append(chunk)
        self._next_seq += 1
        if chunk.finish_reason is not None or chunk.error is not None:
            self.finished = True
            self._held.clear()

    def fail(self, why: str) -> None:
        self.failure = why
        self._wake.set()

    async def next(self, timeout_s: float) -> TokenChunk:
        """The next chunk in order; ``asyncio.TimeoutError`` after ``timeout_s`` without one."""
        if not self._ready and self.failure is None:
            self._wake.clear()  # set again only with a chunk ready or a failure
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        if self.failure is not None:
            raise StreamFailed(self.failure)
        return self._ready.popleft()


class TokenStreams:
    """The gateway's token subscription and its per-request streams."""

    def __init__(self, bus: Bus, gateway_id: str, max_chunks: int = 4096) -> None:
        self.bus = bus
        self.subject = subjects.tokens(gateway_id)
        self.max_chunks = max_chunks
        self.stats = StreamStats()
        self._streams: dict[str, RequestStream] = {}
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self.bus.subscribe(self.subject, self._on_message, span=False)

    async def stop(self) -> None:
        if self._subscription is not None:
            subscription, self._subscription = self._subscription, None
            await subscription.unsubscribe()
        for stream in self._streams.values():
            stream.fail("the gateway is stopping")
        self._streams.clear()

    def open(self, request_id: str, transfer_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id} is already streaming")
        stream = RequestStream(request_id, transfer_id, self.max_chunks)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    async def _on_message(self, subject: str, message: BusMessage) -> None:
        if not isinstance(message, TokenChunk):
            self.stats.unknown += 1
            return
        stream = self._streams.get(message.request_id)
        if stream is None or stream.transfer_id != message.transfer_id:
            self.stats.unknown += 1
            return
        stream.offer(message, self.stats)
        if stream.finished or stream.failure is not None:
            self._streams.pop(message.request_id, None)
