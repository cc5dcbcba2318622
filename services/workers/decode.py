"""Decode worker (``kvpush decode``): receives KV, decodes, streams tokens to the gateway.

Owns what a request means on the decode side: for every RequestEvent on ``kvpush.v1.req.*.<me>``
it submits the prompt with the event's SamplingSpec and transfer parameters (none for mode
local: the engine computes the prompt itself). The connector inside the engine allocates the
prompt's blocks, announces them to the prefill worker and waits (at no cost) for the KV. Each
engine output becomes a TokenChunk on the event's reply subject (``seq`` 0, 1, ...; the last one
carries ``finish_reason``, ``usage`` and ``num_cached_tokens``), whatever the client's
``stream``: the gateway joins them for a whole answer and counts its idle timeout from each. A
request for ``n`` > 1 answers or log-probabilities gets each answer's delta in the chunk's
``outputs`` (one ``SequenceOutput``: the engine host's fan-out hands out one answer's delta at a
time; the prompt's log-probabilities in the first chunk), any other the chunk's
``token_ids``/``text`` as older gateways read them. The event's deadline (the worker's abort
backstop) ends at the first output: an answer has no total deadline. A request it cannot take is
answered with one error chunk at once: ``overloaded`` (over ``--max-inflight``), ``deadline``,
the model mismatch, or the prompt's log-probabilities asked for in push or pull (they need this
engine's own prefill: the gateway sends such a request in mode local).

Each request carries its prefill worker's side channels (from the worker's view of prefill
workers, ``peers``) so the connector can tell a dead prefill worker from a slow one. A prefill
worker that leaves the view (silent past its lease, restarted with a new epoch)
has its side channels probed at once: the connector fails what that worker was sending, so this
worker computes those prompts itself within a lease of a prefill crash.

Threading model: ``Worker``'s (asyncio on the main thread, the engine on its own thread).
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from kvpush.connector import emit_span, monotonic_to_ns, timing_of, tracing_on
from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    FailReason,
    FinishReason,
    RequestEvent,
    Timing,
    TokenChunk,
    TransferMode,
    Usage,
    WorkerRole,
)
from kvpush.services.membership import Member
from kvpush.services.telemetry.breakdown import merge
from kvpush.services.workers.config import WorkerConfig
from kvpush.services.workers.handles import (
    MAX_STOP_STRING,
    EngineOutput,
    RequestHandle,
    sequence_output,
)
from kvpush.services.workers.inflight import InFlight
from kvpush.services.workers.worker import STALLED, Worker, run_worker

log = logging.getLogger(__name__)

MAX_ERROR = 1000  # TokenChunk.error is at most 1024 characters
PROMPT_LOGPROBS_NEED_LOCAL = (
    "prompt_logprobs need the decode engine's own prefill: send the request in mode local,"
    " not push or pull"
)


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


def _first_chunk_span(entry: InFlight, handle: RequestHandle, sending_ns: int) -> None:
    """``decode.first_chunk``: D's engine output of the first token -> the worker about to
    publish its TokenChunk (``sending_ns``: the worker's loop taking the output up). It ends at
    ``sending_ns`` itself, a ``time.time_ns()`` instant, so it orders causally with others."""
    if tracing_on() and handle.first_output_at:
        attrs = {"kvpush.transfer_id": entry.event.transfer_id}
        first_ns = min(monotonic_to_ns(handle.first_output_at), sending_ns)
        emit_span("decode.first_chunk", None, first_ns, sending_ns, attrs)


def wants_outputs(event: RequestEvent) -> bool:
    """Does the event's answer go in ``TokenChunk.outputs`` (several answers, or
    log-probabilities), not in the chunk's ``token_ids``/``text``?"""
    sampling = event.sampling
    asks = sampling.logprobs is not None or sampling.prompt_logprobs is not None
    return sampling.n > 1 or asks


def chunk_fields(out: EngineOutput, outputs: bool) -> dict[str, Any]:
    """The TokenChunk fields of an engine output's delta: ``outputs`` (when ``outputs``: none
    for a request's end that is no answer's, an abort), else ``token_ids``/``text``."""
    if not outputs:
        fields: dict[str, Any] = {"token_ids": out.token_ids, "text": out.text}
        stop = out.stop_reason if out.sequence_finish_reason == "stop" else None
        if stop is not None:
            fields["stop_reason"] = stop[:MAX_STOP_STRING] if isinstance(stop, str) else stop
        return fields
    delta = out.token_ids or out.text or out.sequence_finish_reason is not None
    return {"outputs": [sequence_output(out)] if delta else []}


def _abort_error(entry: InFlight) -> str:
    return "deadline" if entry.aborted == "deadline" else f"aborted: {entry.aborted}"


class DecodeWorker(Worker):
    role = WorkerRole.DECODE

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.peers.on_leave(self._prefill_left)

    def request_filter(self) -> str:
        return subjects.requests_for_decode(self.worker_id)

    def _prefill_left(self, member: Member) -> None:
        """A prefill worker is gone: what it was sending us fails once its side channel does
        not answer (the connector's probe), instead of at the requests' deadlines."""
        beat = member.heartbeat
        log.warning(
            "prefill %s left (%s): probing it",
            beat.worker_id,
            member.why,
        )
        for address in list(beat.side_channels) or [beat.side_channel]:
            self.host.link.suspect_peer(address)

    async def serve(self, entry: InFlight) -> None:
        event = entry.event
        rid, tid = event.request_id, event.transfer_id
        local = event.mode is TransferMode.LOCAL
        if not local and event.sampling.prompt_logprobs is not None:
            await self.refuse(event, FailReason.PREFILL, PROMPT_LOGPROBS_NEED_LOCAL)
            return
        addresses = self.peers.side_channels(event.prefill_id)
        params = None if local else entry.kv_params(addresses)
        handle = self.submit(entry, event.sampling, params)
        if handle is None:
            if entry.aborted != STALLED:
                await self._send(event, 0, {}, FinishReason.ABORT, 0, _abort_error(entry))
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
        outputs = wants_outputs(event)
        seq = count = 0
        async for out in handle:
            count += len(out.token_ids)
            if entry.timer is not None:  # it runs: no total deadline from here on
                entry.timer.cancel()
                entry.timer = None
            fields = chunk_fields(out, outputs)
            if out.prompt_logprobs is not None:  # answer 0's first output: the first chunk
                fields["prompt_logprobs"] = out.prompt_logprobs
            if not out.finished:
                if any(fields.values()):
                    sending_ns = time.time_ns() if seq == 0 else 0
                    await self._send(event, seq, fields)
                    if seq == 0:
                        _first_chunk_span(entry, handle, sending_ns)
                    seq += 1
                continue
            if out.finish_reason == "abort" and entry.aborted == STALLED:
                return  # the gateway counted us gone and moves the request: no error for it
            reason = _finish_reason(out.finish_reason or "stop")
            error = _abort_error(entry) if out.finish_reason == "abort" else out.error
            late = self.host.link.take_timing(tid)  # came up in the request's last step
            marks = _trace(entry, handle, merge(timing_of(out.kv_transfer_params), late))
            fields["num_cached_tokens"] = out.num_cached_tokens
            sending_ns = time.time_ns() if seq == 0 else 0
            await self._send(event, seq, fields, reason, count, error, marks)
            if seq == 0 and count:  # an answer's only chunk (an end without tokens: none)
                _first_chunk_span(entry, handle, sending_ns)
            took = (handle.finished_at or 0.0) - handle.submitted_at
            first = (handle.first_output_at or 0.0) - handle.submitted_at
            log.info(
                "decoded rid=%s tid=%s: %d tokens, %d answers, %s, first output %.3f s,"
                " total %.3f s",
                rid,
                tid,
                count,
                event.sampling.n,
                reason.value,
                first,
                took,
            )

    async def _send(
        self,
        event: RequestEvent,
        seq: int,
        fields: dict[str, Any],
        finish: FinishReason | None = None,
        completion_tokens: int = 0,
        error: str | None = None,
        marks: Timing | None = None,
    ) -> None:
        """One TokenChunk: ``fields`` (from ``chunk_fields``, ``prompt_logprobs``,
        ``num_cached_tokens``), and on the last one its end, usage and timing."""
        prompt_tokens = len(event.prompt_token_ids)
        usage = Usage(prompt_tokens, completion_tokens) if finish is not None else None
        chunk = TokenChunk(
            request_id=event.request_id,
            transfer_id=event.transfer_id,
            seq=seq,
            finish_reason=finish,
            usage=usage,
            error=error[:MAX_ERROR] if error else None,
            timing=marks,
            **fields,
        )
        await self.bus.publish(event.reply_subject, chunk, span=False)

    async def refuse(self, event: RequestEvent, reason: FailReason, detail: str = "") -> None:
        log.warning(
            "refusing rid=%s tid=%s: %s",
            event.request_id,
            event.transfer_id,
            detail or reason.value,
        )
        await self._send(event, 0, {}, FinishReason.ERROR, 0, detail or reason.value)


def main(args: argparse.Namespace) -> int:
    """``kvpush decode``."""
    return run_worker(DecodeWorker, args)
