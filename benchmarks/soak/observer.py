"""The soak's own NATS connection: workers' heartbeats and every request's token ids.

``SoakObserver`` subscribes, on the public v1 contract only, to

- ``kvpush.v1.heartbeat.*.*``: the last heartbeat of each worker and a per-worker sequence
  number, so ``next_beat`` can wait for a heartbeat sent after a given one (the settle loop);
- ``kvpush.v1.req.*.<decode>``: the mode the gateway actually routed each request with (the
  default mode degrades to local while no prefill worker is alive);
- ``kvpush.v1.tokens.<gateway>``: the TokenChunks the decode worker sends the gateway, so the
  soak compares **token ids** (the gateway's OpenAI answers carry only text). The final
  chunk's ``timing.kv_landed`` says whether the KV came from the prefill worker (the gateway's
  own received/fallback rule).

This connection reconnects on its own like the gateway's; around a nats-server restart it may
miss chunks the gateway got (or the other way round): such a request's ids are incomplete and
its answer is counted *unverified*, never ok.

Bounds: at most ``max_requests`` requests are remembered (oldest forgotten first: requests no
client asks about, e.g. ones whose HTTP answer was an error); ``forget`` drops one at once.
Threading model: asyncio, on the soak's loop; handlers never await.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvpush.benchmarks.soak.checks import Observed
from kvpush.connector import BoundedDict, Bus
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import RequestEvent, TokenChunk, WorkerHeartbeat


@dataclass
class _Request:
    mode: str | None = None
    chunks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq -> token ids
    final_seq: int | None = None
    kv_landed: bool = False

    def observed(self) -> Observed:
        ids: list[int] = []
        seq = 0
        while seq in self.chunks:
            ids += self.chunks[seq]
            seq += 1
        complete = self.final_seq is not None and seq == self.final_seq + 1
        return Observed(tuple(ids), complete, self.mode, self.kv_landed)


class SoakObserver:
    """See the module docstring."""

    def __init__(self, bus: Bus, gateway_id: str, decode_id: str, max_requests: int = 4096):
        self.bus = bus
        self.gateway_id = gateway_id
        self.decode_id = decode_id
        self.max_requests = max_requests
        self.beats: dict[str, WorkerHeartbeat] = {}
        self.beat_seq: dict[str, int] = {}
        self._requests: BoundedDict[str, _Request] = BoundedDict(max_requests)
        self._beat = asyncio.Event()
        self._reply = subjects.tokens(gateway_id)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.heartbeats(), self._on_beat, span=False)
        requests = subjects.requests_for_decode(self.decode_id)
        await self.bus.subscribe(requests, self._on_request, span=False)
        await self.bus.subscribe(self._reply, self._on_chunk, span=False)
        await self.bus.flush()

    # ---- heartbeats ------------------------------------------------------------------------
    async def _on_beat(self, subject: str, message: BusMessage) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.beats[message.worker_id] = message
            self.beat_seq[message.worker_id] = self.beat_seq.get(message.worker_id, 0) + 1
            self._beat.set()
            self._beat = asyncio.Event()

    async def next_beat(
        self, worker_id: str, after: int, timeout_s: float
    ) -> tuple[int, WorkerHeartbeat] | None:
        """The first heartbeat of ``worker_id`` numbered above ``after``; None on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.beat_seq.get(worker_id, 0) <= after:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._beat.wait(), remaining)
            except asyncio.TimeoutError:
                return None
        return self.beat_seq[worker_id], self.beats[worker_id]

    # ---- requests and their token chunks ---------------------------------------------------
    def _entry(self, request_id: str) -> _Request:
        entry = self._requests.get(request_id)
        if entry is None:
            entry = self._requests[request_id] = _Request()
        return entry

    async def _on_request(self, subject: str, message: BusMessage) -> None:
        if isinstance(message, RequestEvent) and message.reply_subject == self._reply:
            self._entry(message.request_id).mode = message.mode.value

    async def _on_chunk(self, subject: str, message: BusMessage) -> None:
        if not isinstance(message, TokenChunk):
            return
        entry = self._entry(message.request_id)
        entry.chunks.setdefault(message.seq, tuple(message.token_ids))
        if message.finish_reason is not None or message.error is not None:
            entry.final_seq = message.seq
            entry.kv_landed = message.timing is not None and message.timing.kv_landed > 0

    async def observed(self, request_id: str, timeout_s: float) -> Observed | None:
        """What was seen of ``request_id`` once its final chunk is in (or after ``timeout_s``),
        and forget it; None when nothing of it was seen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            entry = self._requests.get(request_id)
            done = entry is not None and entry.observed().complete
            if done or loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        entry = self._requests.pop(request_id, None)
        return entry.observed() if entry is not None else None
