"""The soak's own NATS connection: workers' heartbeats and every request's token ids.

``SoakObserver`` subscribes, on the public v1 contract only, to

- ``kvpush.v1.heartbeat.*.*``: the last heartbeat of each worker and a per-worker sequence
  number, so ``next_beat`` can wait for a heartbeat sent after a given one (the settle loop);
- ``kvpush.v1.req.*.*`` (this gateway's requests only, by their reply subject): each transfer's
  route (the mode the gateway actually routed, its prefill and decode worker) and prompt. A
  request the gateway moved to other workers (migration) has one transfer per move, the later
  ones with the tokens already sent appended to the prompt;
- ``kvpush.v1.tokens.<gateway>``: the TokenChunks decode workers send the gateway, per
  transfer, so the soak compares **token ids** (the gateway's OpenAI answers carry only text).
  The final chunk's ``timing.kv_landed`` says whether the KV came from the prefill worker, its
  ``timing.kv_cached`` whether D's own prefix cache held the prompt (the gateway's own
  received/cached/fallback rule).

``observed`` gives a request's last transfer (the latest RequestEvent seen): its prompt, its
chunks in order, how often it moved. ``served`` holds, per worker, when it last finished a
request (a decode worker: any answer it ended with stop/length; a prefill worker: one whose
KV landed on D): the soak times a restarted worker's first answer from it.

This connection reconnects on its own like the gateway's; around a nats-server restart it may
miss chunks or events the gateway got (or the other way round): such a request's ids are
incomplete and its answer is counted *unverified*, never ok.

Bounds: at most ``max_requests`` requests are remembered (oldest forgotten first: requests no
client asks about, e.g. ones whose HTTP answer was an error), at most ``MAX_TRANSFERS`` transfers
each; ``observed`` forgets a request at once.
Threading model: asyncio, on the soak's loop; handlers never await.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvpush.benchmarks.soak.checks import Observed
from kvpush.connector import BoundedDict, Bus
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    FinishReason,
    RequestEvent,
    TokenChunk,
    TransferMode,
    WorkerHeartbeat,
)

MAX_TRANSFERS = 16  # per request: past --migration-limit
ANSWERED = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass
class _Transfer:
    event: RequestEvent | None = None
    chunks: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq -> token ids
    final_seq: int | None = None
    kv_landed: bool = False
    kv_cached: bool = False

    def ids(self) -> tuple[tuple[int, ...], bool]:
        """The chunks' ids from seq 0 without a gap, and whether they are all there."""
        ids: list[int] = []
        seq = 0
        while seq in self.chunks:
            ids += self.chunks[seq]
            seq += 1
        return tuple(ids), self.final_seq is not None and seq == self.final_seq + 1


@dataclass
class _Request:
    transfers: dict[str, _Transfer] = field(default_factory=dict)  # in the order first seen
    order: list[str] = field(default_factory=list)  # transfer ids, by their RequestEvent

    def transfer(self, transfer_id: str) -> _Transfer | None:
        found = self.transfers.get(transfer_id)
        if found is None and len(self.transfers) < MAX_TRANSFERS:
            found = self.transfers[transfer_id] = _Transfer()
        return found

    def observed(self) -> Observed:
        # no RequestEvent seen: the chunks alone, never complete
        last = self.transfers[self.order[-1] if self.order else next(iter(self.transfers))]
        ids, complete = last.ids()
        event = last.event
        return Observed(
            token_ids=ids,
            complete=complete and event is not None,
            mode=event.mode.value if event is not None else None,
            kv_landed=last.kv_landed,
            kv_cached=last.kv_cached,
            prompt_ids=tuple(event.prompt_token_ids) if event is not None else (),
            moves=max(0, len(self.order) - 1),
        )


class SoakObserver:
    """See the module docstring."""

    def __init__(self, bus: Bus, gateway_id: str, max_requests: int = 4096):
        self.bus = bus
        self.gateway_id = gateway_id
        self.max_requests = max_requests
        self.beats: dict[str, WorkerHeartbeat] = {}
        self.beat_seq: dict[str, int] = {}
        self.served: dict[str, float] = {}  # worker id -> time.monotonic() of its last answer
        self._requests: BoundedDict[str, _Request] = BoundedDict(max_requests)
        self._beat = asyncio.Event()
        self._reply = subjects.tokens(gateway_id)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.heartbeats(), self._on_beat, span=False)
        requests = f"{subjects.ROOT}.req.*.*"  # every prefill and decode worker's
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
        if not isinstance(message, RequestEvent) or message.reply_subject != self._reply:
            return
        entry = self._entry(message.request_id)
        transfer = entry.transfer(message.transfer_id)
        if transfer is not None and transfer.event is None:
            transfer.event = message
            entry.order.append(message.transfer_id)

    async def _on_chunk(self, subject: str, message: BusMessage) -> None:
        if not isinstance(message, TokenChunk):
            return
        transfer = self._entry(message.request_id).transfer(message.transfer_id)
        if transfer is None:
            return
        transfer.chunks.setdefault(message.seq, tuple(message.token_ids))
        if message.finish_reason is not None or message.error is not None:
            transfer.final_seq = message.seq
            transfer.kv_landed = message.timing is not None and message.timing.kv_landed > 0
            transfer.kv_cached = message.timing is not None and message.timing.kv_cached > 0
            event = transfer.event
            if event is not None and message.error is None and message.finish_reason in ANSWERED:
                now = time.monotonic()
                self.served[event.decode_id] = now
                if event.mode is not TransferMode.LOCAL and transfer.kv_landed:
                    self.served[event.prefill_id] = now

    async def observed(self, request_id: str, timeout_s: float) -> Observed | None:
        """What was seen of ``request_id``'s last transfer once it is complete (or after
        ``timeout_s``), and forget the request; None when nothing of it was seen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            entry = self._requests.get(request_id)
            done = entry is not None and entry.transfers and entry.observed().complete
            if done or loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        entry = self._requests.pop(request_id, None)
        return entry.observed() if entry is not None and entry.transfers else None
