"""One engine request of the gateway, from the prompt's token ids to its last chunk
(``BusGeneration``), and what a handler tells it (``RequestContext``).

vLLM's serving layer calls ``BusEngineClient.generate`` once per prompt (a batch of prompts: once
each; ``n`` answers: once, D runs them). Each call is a ``BusGeneration``: route (503) ->
open a token stream -> publish ONE RequestEvent on ``req.<P>.<D>`` inside the handler's
``gateway.request`` span (both workers see its trace context) -> the chunks, in order, until
the final one. Deadlines: ``request_timeout_s`` from the start to the first chunk (the
RequestEvent's ``deadline_ms``: the KV transfer's too), then ``stream_idle_timeout_s`` between
chunks; an answer has no total deadline. A worker error is ``ApiError`` 502, a deadline 504, a
stream overflow 503; the error is also left on the ``RequestContext`` so the handler can answer
with its status when nothing was sent yet.

A request whose worker is lost moves to other workers (``migration``: the prompt plus the tokens
already sent, at most ``--migration-limit`` times); each move is counted in the span's
``kvpush.migrations`` and in ``kvpush_gateway_migrations{lost=decode|prefill|bus}``. A lost
decode worker with nowhere to move the request is a 502 at once (after a bus break: once the
workers are not heard again within ``BUS_GRACE_LEASES`` leases, a 503). Whenever a request ends
before its final chunk (client gone, deadline, decode worker lost or restarted, overflow,
gateway stopping) it publishes ``Abort(transfer_id, sender=gateway_id)`` to P (when P takes
part) and to D; after a worker error, to P only.

Threading model: runs on the gateway's loop, in the task of the handler that iterates vLLM's
generator. aiohttp cancels a handler whose client disconnected (``handler_cancellation=True``);
``finish`` (in the generator's ``finally``) hands the abort to a tracked background task, so it
is sent although the handler is cancelled.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    FinishReason,
    RequestEvent,
    Timing,
    TokenChunk,
    TransferMode,
    WorkerRole,
)
from kvpush.services.gateway.errors import ApiError
from kvpush.services.gateway.migration import Lost, Migration
from kvpush.services.gateway.observe import FinishedRequest
from kvpush.services.gateway.route_choice import record_decision
from kvpush.services.gateway.routing import first_token_by
from kvpush.services.gateway.streaming import StreamFailed
from kvpush.services.gateway.worker_registry import NoWorkerError

if TYPE_CHECKING:
    from kvpush.connector import Bus
    from kvpush.schemas.sampling import SamplingSpec
    from kvpush.services.gateway.config import GatewayConfig
    from kvpush.services.gateway.metrics import GatewayMetrics
    from kvpush.services.gateway.observe import Observer
    from kvpush.services.gateway.routing import Route, Router
    from kvpush.services.gateway.streaming import TokenStreams

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvpush.gateway")
LIVENESS_POLL_S = 0.5  # how often a waiting request checks that its workers live
BUS_GRACE_LEASES = 3  # after a bus break, how long (in worker leases) requests wait for workers
# a request whose P was lost with no other P alive: how long (in leases) D's own fallback has
# before the request moves to LOCAL (D falls back within a lease and a 1 s probe of a dead P;
# a stopped P is not dead: D keeps its blocks, and the request moves to fresh ones)
PREFILL_GRACE_LEASES = 6
_BUS_ID = re.compile(r"[^A-Za-z0-9._:-]")


@dataclasses.dataclass
class RequestContext:
    """What the handler of one HTTP request tells its engine requests, and learns back."""

    span: Span
    mode: TransferMode | None = None  # the kvpush_mode extension
    # when the request arrived (the loop's clock, and unix ns): its deadline and TTFT count
    # from here, whatever parsing and tokenizing took
    arrived: float = dataclasses.field(default_factory=lambda: asyncio.get_running_loop().time())
    arrived_ns: int = dataclasses.field(default_factory=time.time_ns)
    error: ApiError | None = None  # the first error an engine request raised
    sent_first: bool = False  # some answer's first chunk came
    rendered: bool = False  # its gateway.render span was made (once, by the first engine request)
    # the answer's id (``cmpl-<id>``, ``chatcmpl-<id>``): its first engine request goes on the
    # bus (and in traces and the dashboard) under it, later prompts of a batch as vLLM names them
    response_id: str = ""


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "kvpush_request", default=None
)


class GenerationHost(Protocol):
    """What a generation needs of the gateway (``http_server.GatewayApi`` is the one
    implementation)."""

    config: GatewayConfig
    bus: Bus
    router: Router
    streams: TokenStreams
    metrics: GatewayMetrics
    observer: Observer
    spawn: Callable[[Awaitable[None]], None]
    served_name: str

    async def abort(self, route: Route, transfer_id: str, reason: str, *, decode: bool) -> None: ...


def bus_request_id(request_id: str) -> str:
    """vLLM's request id (it may come from a client's X-Request-Id) as the bus allows it."""
    return _BUS_ID.sub("_", request_id)[-128:] or "request"


class BusGeneration:
    """One engine request over the bus; see the module docstring."""

    def __init__(self, gw: GenerationHost, context: RequestContext, request_id: str) -> None:
        self.gw, self.context = gw, context
        self.loop = asyncio.get_running_loop()
        self.arrived, self.arrived_ns = context.arrived, context.arrived_ns
        self.request_id = bus_request_id(request_id)
        self.transfer_id = secrets.token_urlsafe(16)
        self.published_ns = self.first_byte_ns = self.last_chunk_ns = 0
        self.worker_timing: Timing | None = None  # from the last TokenChunk
        self.cached_tokens: int | None = None  # ... its num_cached_tokens (the cost model's)
        self.first_at: float | None = None
        self.ended = False  # D reported the end (final chunk or error): nothing to abort on D
        self.worker_error = False  # ... with an error: P may still be working, abort it
        self.abort_reason = "client disconnected"
        self.completion_tokens = self.prompt_tokens = 0
        self.route: Route | None = None
        self.route_reason = ""  # record_decision's
        self.prompt_ids: list[int] = []
        self.streamed = False
        self.migration: Migration | None = None
        self.first_byte: Span | None = None  # the span until the first token

    def _fail(self, error: ApiError) -> ApiError:
        if self.context.error is None:
            self.context.error = error
        return error

    async def start(self, ids: list[int], sampling: SamplingSpec, stream: bool) -> None:
        """Route and publish; ApiError 503 when no worker can take it, 413 when too large."""
        self.prompt_ids, self.streamed = ids, stream
        self.prompt_tokens = len(ids)
        limit, reconnects = self.gw.config.migration_limit, self.gw.bus.stats.reconnects
        self.migration = Migration(limit, sampling, reconnects)
        await self._dispatch(ids, sampling, self.arrived)
        self.gw.metrics.prompt_tokens.inc(len(ids))

    async def _dispatch(self, ids: list[int], sampling: SamplingSpec, since: float) -> None:
        """Route, open the stream and publish one RequestEvent (the first, or a migration's);
        its first chunk is due ``request_timeout_s`` after ``since``."""
        gw, config = self.gw, self.gw.config
        mode = self.context.mode
        if sampling.prompt_logprobs is not None:
            mode = TransferMode.LOCAL  # they need the prompt's logits: D computes the prompt
        with _tracer.start_as_current_span("gateway.route"):
            try:
                try:
                    route = gw.router.route(ids, mode)
                except NoWorkerError as exc:
                    moved = self.migration is not None and self.migration.count
                    if moved and exc.role is WorkerRole.PREFILL:
                        mode = TransferMode.LOCAL  # moved: not a 503
                    elif not await gw.router.registry.back(exc.role, config.worker_lease_s * 3):
                        raise  # none came back within three leases (one missed its lease)
                    route = gw.router.route(ids, mode)
            except NoWorkerError as exc:
                raise self._fail(
                    ApiError(503, str(exc), type_="service_unavailable", code="no_workers")
                ) from None
        self.route = route
        span, metrics = self.context.span, gw.metrics
        self.route_reason = record_decision(route.mode, route.explanation, mode, span, metrics)
        self.deadline = since + config.request_timeout_s
        event = RequestEvent(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            prefill_id=route.prefill_id,
            decode_id=route.decode_id,
            model=gw.served_name,
            prompt_token_ids=ids,
            reply_subject=gw.streams.subject,
            deadline_ms=int((time.time() + config.request_timeout_s) * 1000),
            sampling=sampling,
            mode=route.mode,
            stream=self.streamed,
            first_token_by=first_token_by(config.first_token, route, sampling),
        )
        self.context.span.set_attributes(
            {
                "gen_ai.request.model": gw.served_name,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.usage.input_tokens": self.prompt_tokens,
                "kvpush.request_id": self.request_id,
                "kvpush.transfer_id": self.transfer_id,
                "kvpush.mode": route.mode.value,
                "kvpush.prefill_id": route.prefill_id,
                "kvpush.decode_id": route.decode_id,
            }
        )
        log.debug("request %s transfer %s -> %s", self.request_id, self.transfer_id, route)
        self.stream = gw.streams.open(self.request_id, self.transfer_id)
        if self.first_byte is None:
            self.first_byte = _tracer.start_span("gateway.first_byte")
        self.published_ns = self.published_ns or time.time_ns()  # the first publish's start
        await self._publish(event)
        gw.observer.track(self.transfer_id, route.mode.value)
        gw.metrics.routed.labels(route.mode.value).inc()

    async def _migrate(self, lost: Lost) -> None:
        """Move the request off what it lost (``migration``)."""
        gw, route, migration = self.gw, self.route, self.migration
        assert route is not None and migration is not None
        extra, owed = migration.moved(gw.bus.stats.reconnects)
        gw.metrics.migrations.labels(lost.value).inc()
        log.warning(
            "%s lost under %s (%s/%s) after %d token(s): migration %d",
            lost.value,
            self.request_id,
            route.prefill_id,
            route.decode_id,
            len(extra),
            migration.count,
        )
        gw.spawn(gw.abort(route, self.transfer_id, f"{lost.value} lost: migrated", decode=True))
        gw.streams.close(self.request_id)
        self.transfer_id = secrets.token_urlsafe(16)
        span = self.context.span
        span.set_attribute("kvpush.migrations", migration.count)
        span.add_event("kvpush.migrated", {"kvpush.lost": lost.value, "tokens": len(extra)})
        await self._dispatch([*self.prompt_ids, *extra], owed, self.loop.time())

    async def _on_stall(self) -> None:
        """No chunk for a poll: move the request if it lost a worker, or fail it (502/503)."""
        gw, route, migration = self.gw, self.route, self.migration
        assert route is not None and migration is not None
        reconnects = gw.bus.stats.reconnects
        lost = migration.lost(gw.router, route, self.first_at is not None, reconnects)
        if lost is None:
            return
        # a lost P matters at once only if another P can do better than D's own fallback
        needed = WorkerRole.PREFILL if lost is Lost.PREFILL else WorkerRole.DECODE
        if migration.movable() and gw.router.registry.alive(needed):
            await self._migrate(lost)
            return
        bus_broke = reconnects != migration.reconnects or not gw.bus.client.is_connected
        lease = gw.config.worker_lease_s
        grace = (PREFILL_GRACE_LEASES if lost is Lost.PREFILL else BUS_GRACE_LEASES) * lease
        if migration.waits(lost, self.loop.time(), bus_broke, grace):
            return
        if lost is Lost.PREFILL:  # D's fallback did not come: P may be stopped, not dead
            if migration.movable() and gw.router.registry.alive(WorkerRole.DECODE):
                await self._migrate(lost)  # LOCAL, in fresh blocks
            return
        if lost is Lost.BUS:
            self.abort_reason = "bus interrupted"
            message = "the message bus was interrupted and the request was lost; retry it"
            raise self._fail(ApiError(503, message, type_="service_unavailable"))
        self.abort_reason = "decode worker lost"
        message = f"decode worker {route.decode_id} was lost or restarted"
        raise self._fail(ApiError(502, message, type_="worker_error"))

    def finish(self) -> None:
        """The request is over (answered, failed or abandoned): abort what still runs."""
        gw, route = self.gw, self.route
        if route is None:
            return
        gw.router.ended(route, started=self.first_at is not None)  # D's load drops now
        gw.streams.close(self.request_id)
        if self.first_at is None and self.first_byte is not None:
            self.first_byte.end()
        gw.metrics.completion_tokens.inc(self.completion_tokens)
        span = self.context.span
        span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if not self.ended:
            gw.metrics.aborts.labels(self.abort_reason.split(":")[0]).inc()
            span.set_status(StatusCode.ERROR, self.abort_reason)
            log.info("aborting %s (%s): %s", self.request_id, self.transfer_id, self.abort_reason)
            gw.spawn(gw.abort(route, self.transfer_id, self.abort_reason, decode=True))
        elif self.worker_error and route.prefill_epoch is not None:
            gw.spawn(gw.abort(route, self.transfer_id, "decode worker error", decode=False))
        elif not self.worker_error and not (self.migration and self.migration.count):
            timing, published = self.worker_timing, self.published_ns  # teach the cost model
            gw.router.learn(route, len(self.prompt_ids), self.cached_tokens, timing, published)
        gw.observer.finished(self._finished())

    def _finished(self) -> FinishedRequest:
        context = self.context.span.get_span_context()
        ok = self.ended and not self.worker_error
        route = self.route
        assert route is not None
        return FinishedRequest(
            request_id=self.request_id,
            transfer_id=self.transfer_id,
            trace_id=f"{context.trace_id:032x}" if context.trace_id else "",
            mode=route.mode.value,
            status="ok" if ok else self.abort_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            arrived_ns=self.arrived_ns,
            published_ns=self.published_ns,
            first_byte_ns=self.first_byte_ns,
            last_chunk_ns=self.last_chunk_ns,
            worker_timing=self.worker_timing,
            route=route.note(self.route_reason),
        )

    def _first_byte(self) -> None:
        if self.first_at is not None:
            return
        self.first_at = self.loop.time()
        self.first_byte_ns = time.time_ns()
        if self.first_byte is not None:
            self.first_byte.end()
        self.context.sent_first = True
        assert self.route is not None
        self.gw.router.started(self.route)  # a LOCAL request runs on D now
        self.gw.metrics.ttft.labels(self.route.mode.value).observe(self.first_at - self.arrived)

    async def _publish(self, event: RequestEvent) -> None:
        try:
            await self.gw.bus.publish(subjects.request(event.prefill_id, event.decode_id), event)
        except nats.errors.MaxPayloadError:
            error = ApiError(413, "the prompt is too large for the message bus")
            raise self._fail(error) from None
        except (nats.errors.Error, OSError) as exc:
            log.warning("publish of %s failed: %r", event.request_id, exc)
            error = ApiError(503, "the message bus is unavailable", type_="service_unavailable")
            raise self._fail(error) from None

    async def next(self) -> TokenChunk:
        """The next chunk in order, or ApiError: 504 deadline, 502 worker lost, 503 overflow."""
        assert self.route is not None
        while True:
            remaining = self.deadline - self.loop.time()
            if remaining <= 0:
                self.abort_reason = "deadline"
                config = self.gw.config
                if self.completion_tokens or self.first_at is not None:
                    why = f"no token for {config.stream_idle_timeout_s:g} s"
                else:
                    why = f"no first token after {config.request_timeout_s:g} s"
                error = ApiError(504, f"request timed out: {why}", type_="timeout", code="timeout")
                route = self.route
                log.warning(
                    "%s (transfer %s) timed out: %s (mode %s, prefill %s, decode %s)",
                    self.request_id, self.transfer_id, why, route.mode.value,
                    route.prefill_id, route.decode_id,
                )  # fmt: skip
                raise self._fail(error)
            waited_from = self.loop.time()
            try:
                chunk = await self.stream.next(min(remaining, LIVENESS_POLL_S))
            except asyncio.TimeoutError:
                # a wait that overran by a lease: this loop stalled, and the heartbeats queued
                # meanwhile must be read before anyone is judged gone
                if self.loop.time() - waited_from < LIVENESS_POLL_S + self.gw.config.worker_lease_s:
                    await self._on_stall()
                continue
            except StreamFailed as exc:
                self.abort_reason = f"stream failed: {exc}"
                raise self._fail(ApiError(503, str(exc), type_="service_unavailable")) from None
            return self._took(chunk)

    def _took(self, chunk: TokenChunk) -> TokenChunk:
        # no total deadline: from the first chunk on, only the gap between chunks counts
        self.deadline = self.loop.time() + self.gw.config.stream_idle_timeout_s
        new = len(chunk.token_ids) + sum(len(o.token_ids) for o in chunk.outputs or [])
        self.completion_tokens += new
        if self.migration is not None:
            self.migration.record(chunk)
            self.migration.delivered(self.gw.bus.stats.reconnects)
        if new or chunk.text or chunk.outputs:
            self._first_byte()
        if chunk.finish_reason is not None:
            self.last_chunk_ns = time.time_ns()
            self.worker_timing, self.cached_tokens = chunk.timing, chunk.num_cached_tokens
        if chunk.error is not None or chunk.finish_reason is FinishReason.ERROR:
            self.ended = self.worker_error = True
            why = chunk.error or "unspecified"
            self.abort_reason = f"worker error: {why}"[:200]  # its status; D is done
            self.context.span.set_status(StatusCode.ERROR, f"worker error: {why}")
            raise self._fail(ApiError(502, f"worker error: {why}", type_="worker_error"))
        if chunk.finish_reason is not None:
            self._first_byte()
            self.ended = True
            assert self.route is not None
            self.gw.metrics.e2e.labels(self.route.mode.value).observe(
                self.loop.time() - self.arrived
            )
            if chunk.usage is not None:
                before = self.migration.tokens_before if self.migration else 0
                self.completion_tokens = before + chunk.usage.completion_tokens
            self.context.span.set_attribute(
                "gen_ai.response.finish_reasons", [chunk.finish_reason.value]
            )
        return chunk
