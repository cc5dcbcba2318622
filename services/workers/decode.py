"""Decode worker (``kvpush decode``): receives KV, decodes, streams tokens to the gateway.

Owns what a request means on the decode side: for every RequestEvent on ``kvpush.v1.req.*.<me>``
it submits the prompt with the event's SamplingSpec and transfer parameters (none for mode
local: the engine computes the prompt itself). The connector inside the engine allocates the
prompt's blocks, announces them to the prefill worker and waits (at no cost) for the KV. Each
engine output becomes a TokenChunk on the event's reply subject (``seq`` 0, 1, ...; the last one
carries ``finish_reason`` and ``usage``), whatever the client's ``stream``: the gateway joins
them for a whole answer and counts its idle timeout from each. The event's deadline (the
worker's abort backstop) ends at the first output: an answer has no total deadline. A request it
cannot take is answered with one error chunk at once: ``overloaded`` (over ``--max-inflight``),
``deadline``, or the model mismatch.

It also owns the prefill workers' side-channel addresses, learned from their heartbeats
(``kvpush.v1.heartbeat.prefill.*``) and, at start, from the worker registry: each request
carries its prefill worker's address so the connector can tell a dead prefill worker from a
slow one. The map holds at most ``MAX_PREFILL_PEERS`` workers (oldest forgotten first). A
prefill worker silent for ``prefill_lease_s`` (or back with a new epoch) is handed to the
connector as a suspect: it probes the side channel and fails what that worker was sending at
once, so this worker computes those prompts itself within seconds of a prefill crash.

Threading model: ``Worker``'s (asyncio on the main thread, the engine on its own thread).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from kvpush.connector import BoundedDict, emit_span, monotonic_to_ns, timing_of, tracing_on
from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    FailReason,
    FinishReason,
    RequestEvent,
    Timing,
    TokenChunk,
    TransferMode,
    Usage,
    WorkerHeartbeat,
    WorkerRole,
)
from kvpush.services.telemetry.breakdown import merge
from kvpush.services.workers.config import WorkerConfig
from kvpush.services.workers.handles import EngineOutput, RequestHandle
from kvpush.services.workers.worker import InFlight, Worker, run_worker

log = logging.getLogger(__name__)

MAX_PREFILL_PEERS = 4096
MAX_ERROR = 1000  # TokenChunk.error is at most 1024 characters


def _finish_reason(value: str) -> FinishReason:
    try:
        return FinishReason(value)
    except ValueError:
        return FinishReason.ERROR


def _trace(entry: InFlight, handle: RequestHandle, learned: Timing | None) -> Timing:
    """D's critical-path instants (with what the connector learned from P), and D's spans
    ``decode.receive`` (event to engine) and ``decode.first_token`` (KV here, or the request
    in the engine for mode local, to the first token)."""
    tid = entry.event.transfer_id
    submitted_ns = monotonic_to_ns(handle.submitted_at)
    first_ns = monotonic_to_ns(handle.first_output_at) if handle.first_output_at else 0
    marks = merge(learned, Timing(decode_received=entry.received_ns, first_token=first_ns))
    if tracing_on():
        attrs = {"kvpush.transfer_id": tid, "kvpush.mode": entry.event.mode.value}
        emit_span("decode.receive", None, entry.received_ns, submitted_ns, attrs)
        start = marks.kv_landed if marks.kv_landed >= submitted_ns else submitted_ns
        emit_span("decode.first_token", None, start, first_ns, attrs)
    return marks


def _abort_error(entry: InFlight) -> str:
    return "deadline" if entry.aborted == "deadline" else f"aborted: {entry.aborted}"


class DecodeWorker(Worker):
    role = WorkerRole.DECODE

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        # prefill worker id -> its side channels, one per TP rank
        self.prefill_addresses: BoundedDict[str, list[str]] = BoundedDict(MAX_PREFILL_PEERS)
        # worker id -> (epoch, last heartbeat, monotonic) of each prefill worker heard from
        self._prefill_seen: dict[str, tuple[int, float]] = {}
        self._lease_task: asyncio.Task[None] | None = None

    def request_filter(self) -> str:
        return subjects.requests_for_decode(self.worker_id)

    async def on_start(self) -> None:
        for beat in await self.registry_entries(WorkerRole.PREFILL):
            self._learn(beat)
        await self.bus.subscribe(subjects.heartbeats(WorkerRole.PREFILL), self._on_heartbeat)
        self._lease_task = asyncio.create_task(self._watch_leases(), name="prefill-leases")

    async def cleanup(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        await super().cleanup()

    async def _watch_leases(self) -> None:
        """A prefill worker silent for ``prefill_lease_s`` is suspected: the connector probes
        its side channel and, if nobody answers, fails what it was sending us at once (we then
        compute those prompts ourselves) instead of waiting for the requests' deadlines."""
        lease = self.config.prefill_lease_s
        while True:
            await asyncio.sleep(min(1.0, lease / 3))
            now = time.monotonic()
            for worker_id, (_, seen) in list(self._prefill_seen.items()):
                if now - seen > lease:
                    del self._prefill_seen[worker_id]
                    addresses = self.prefill_addresses.get(worker_id) or []
                    if addresses:
                        log.warning("prefill %s silent for %.1f s: probing it", worker_id, lease)
                    for address in addresses:
                        self.host.link.suspect_peer(address)

    async def _on_heartbeat(self, subject: str, message: object) -> None:
        if isinstance(message, WorkerHeartbeat):
            self._learn(message)

    def _learn(self, beat: WorkerHeartbeat) -> None:
        previous = self.prefill_addresses.get(beat.worker_id) or []
        current = list(beat.side_channels) or [beat.side_channel]
        epoch = self._prefill_seen.get(beat.worker_id, (beat.epoch, 0.0))[0]
        if previous and (previous != current or epoch != beat.epoch):
            for address in previous:  # restarted: its old incarnation sends nothing more
                self.host.link.suspect_peer(address)
        self._prefill_seen[beat.worker_id] = (beat.epoch, time.monotonic())
        self.prefill_addresses.refresh(beat.worker_id, current)

    async def serve(self, entry: InFlight) -> None:
        event = entry.event
        rid, tid = event.request_id, event.transfer_id
        local = event.mode is TransferMode.LOCAL
        addresses = self.prefill_addresses.get(event.prefill_id)
        params = None if local else self.kv_params(entry, addresses)
        handle = self.submit(entry, event.sampling, params)
        if handle is None:
            await self._send(event, 0, [], "", FinishReason.ABORT, 0, _abort_error(entry))
            return
        log.info(
            "decode rid=%s tid=%s: %d prompt tokens, mode %s, prefill %s (%s)",
            rid,
            tid,
            len(event.prompt_token_ids),
            event.mode.value,
            event.prefill_id,
            ", ".join(addresses or []),
        )
        seq = count = 0
        async for out in handle:
            count += len(out.token_ids)
            if entry.timer is not None:  # it runs: no total deadline from here on
                entry.timer.cancel()
                entry.timer = None
            if not out.finished:
                if out.token_ids or out.text:
                    await self._send(event, seq, out.token_ids, out.text)
                    seq += 1
                continue
            reason = _finish_reason(out.finish_reason or "stop")
            error = self._error(entry, out)
            ids, text = out.token_ids, out.text
            late = self.host.link.take_timing(tid)  # came up in the request's last step
            marks = _trace(entry, handle, merge(timing_of(out.kv_transfer_params), late))
            await self._send(event, seq, ids, text, reason, count, error, marks)
            took = (handle.finished_at or 0.0) - handle.submitted_at
            first = (handle.first_output_at or 0.0) - handle.submitted_at
            log.info(
                "decoded rid=%s tid=%s: %d tokens, %s, first output %.3f s, total %.3f s",
                rid,
                tid,
                count,
                reason.value,
                first,
                took,
            )

    @staticmethod
    def _error(entry: InFlight, out: EngineOutput) -> str | None:
        return _abort_error(entry) if out.finish_reason == "abort" else out.error

    async def _send(
        self,
        event: RequestEvent,
        seq: int,
        token_ids: list[int],
        text: str,
        finish: FinishReason | None = None,
        completion_tokens: int = 0,
        error: str | None = None,
        marks: Timing | None = None,
    ) -> None:
        usage = None
        if finish is not None:
            usage = Usage(
                prompt_tokens=len(event.prompt_token_ids), completion_tokens=completion_tokens
            )
        chunk = TokenChunk(
            request_id=event.request_id,
            transfer_id=event.transfer_id,
            seq=seq,
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            usage=usage,
            error=error[:MAX_ERROR] if error else None,
            timing=marks,
        )
        await self.bus.publish(event.reply_subject, chunk, span=False)

    async def refuse(self, event: RequestEvent, reason: FailReason, detail: str = "") -> None:
        log.warning(
            "refusing rid=%s tid=%s: %s",
            event.request_id,
            event.transfer_id,
            detail or reason.value,
        )
        await self._send(event, 0, [], "", FinishReason.ERROR, 0, detail or reason.value)


def main(args: argparse.Namespace) -> int:
    """``kvpush decode``."""
    return run_worker(DecodeWorker, args)
