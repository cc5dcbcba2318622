"""What the gateway learns about its requests after the fact: TTFT breakdowns and KV transfers.

``Observer`` owns two inputs and feeds the metrics and the ``/dashboard`` ring:

- ``finished(...)``: every generation request at its end. The gateway's own instants (arrival,
  RequestEvent published, first byte) merged with the ``timing`` the decode worker put on the
  last TokenChunk (D's and P's instants) give the request's ``Breakdown``: observed in
  ``kvpush_gateway_ttft_part_seconds{part}``, TPOT in its histogram, and kept in
  ``RecentRequests`` for the dashboard, with its routing decision (``RouteNote``).
- ``on_kv_event``: KvPushed / KvReady / KvFailed seen on ``kvpush.v1.kv.*.*``, counted only for
  transfers of this gateway (``track`` remembers the last ``MAX_TRACKED`` transfer ids), so two
  gateways never count one transfer twice.

Threading model: the gateway's event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.connector import BoundedDict
from kvpush.schemas.messages import KvFailed, KvPushed, KvReady, Timing
from kvpush.services.gateway.dashboard import RecentRequests
from kvpush.services.gateway.metrics import GatewayMetrics
from kvpush.services.gateway.route_choice import RouteNote
from kvpush.services.telemetry.breakdown import PART_NAMES, breakdown, merge

MAX_TRACKED = 8192


def outcome_of(timing: Timing | None) -> str:
    """A served push/pull request's KV outcome: ``received`` (the KV came from P), ``cached``
    (D's own prefix cache held the prompt: nothing to move) or ``fallback`` (D computed it)."""
    if timing is not None and timing.kv_landed > 0:
        return "received"
    return "cached" if timing is not None and timing.kv_cached > 0 else "fallback"


@dataclass(frozen=True)
class FinishedRequest:
    """The gateway's view of one ended generation request."""

    request_id: str
    transfer_id: str
    trace_id: str
    mode: str
    status: str  # "ok", or why it ended early ("worker error: ...", "deadline", ...)
    prompt_tokens: int
    completion_tokens: int
    arrived_ns: int
    published_ns: int
    first_byte_ns: int  # 0: no first byte
    last_chunk_ns: int  # 0: no final chunk
    worker_timing: Timing | None
    route: RouteNote | None = None  # the routing decision, for the dashboard's row


class Observer:
    def __init__(self, metrics: GatewayMetrics, recent: RecentRequests) -> None:
        self.metrics = metrics
        self.recent = recent
        self._modes: BoundedDict[str, str] = BoundedDict(MAX_TRACKED)  # transfer id -> mode
        self.counts = {"ok": 0, "failed": 0, "kv_failed": 0}

    def track(self, transfer_id: str, mode: str) -> None:
        self._modes[transfer_id] = mode

    async def on_kv_event(self, subject: str, message: object) -> None:
        if not isinstance(message, (KvPushed, KvReady, KvFailed)):
            return
        mode = self._modes.get(message.transfer_id)
        if mode is None:
            return  # another gateway's transfer
        m = self.metrics
        if isinstance(message, KvPushed):
            m.kv_transfers.labels("done").inc()
            m.kv_bytes.labels(mode).inc(message.bytes)
            m.kv_seconds.labels(mode).observe(message.push_ms / 1000.0)
        elif isinstance(message, KvReady):
            m.kv_transfers.labels("ready").inc()
        else:
            self.counts["kv_failed"] += 1
            m.kv_transfers.labels("failed").inc()
            m.kv_failures.labels(message.reason.value).inc()

    def finished(self, request: FinishedRequest) -> None:
        self.counts["ok" if request.status == "ok" else "failed"] += 1
        outcome = ""
        if request.status == "ok" and request.mode != "local":
            outcome = outcome_of(request.worker_timing)
            self.metrics.kv_outcomes.labels(request.mode, outcome).inc()
        own = Timing(
            arrived=request.arrived_ns,
            published=request.published_ns,
            first_byte=request.first_byte_ns,
        )
        found = breakdown(
            merge(own, request.worker_timing),
            trace_id=request.trace_id,
            request_id=request.request_id,
            mode=request.mode,
        )
        if found is not None and request.status == "ok":
            for name, ms in zip(PART_NAMES, found.parts_ms, strict=True):
                self.metrics.ttft_part.labels(name).observe(ms / 1000.0)
        streamed = request.last_chunk_ns > request.first_byte_ns > 0  # stream=false: one chunk
        if streamed and request.completion_tokens > 1:
            tpot_s = (request.last_chunk_ns - request.first_byte_ns) / 1e9
            self.metrics.tpot.labels(request.mode).observe(tpot_s / (request.completion_tokens - 1))
        end_ns = request.last_chunk_ns or request.first_byte_ns or request.arrived_ns
        self.recent.add(
            found,
            request_id=request.request_id,
            mode=request.mode,
            status=request.status,
            prompt_tokens=request.prompt_tokens,
            completion_tokens=request.completion_tokens,
            ttft_ms=found.ttft_ms if found is not None else None,
            e2e_ms=max(0.0, (end_ns - request.arrived_ns) / 1e6),
            kv=outcome,
            route=request.route,
        )
