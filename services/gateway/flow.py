"""One generation request's flow, from body bytes to the last byte sent (``RequestFlow``).

Check capacity (429, in ``GatewayApi``) -> read and parse the body (400/413) -> model (404) ->
tokenize on the tokenizer thread -> context check (400) -> route (503) -> open a token stream ->
publish ONE RequestEvent on ``req.<P>.<D>`` inside the ``gateway.request`` span (both workers
see its trace context) -> answer from the stream: JSON, or SSE opened at the first chunk, so
errors before it still get a proper status (502 worker error, 504 deadline); errors after it
become an ``{"error": ...}`` event then ``[DONE]``. Deadlines: ``request_timeout_s`` from the
start to the first chunk (the RequestEvent's ``deadline_ms``: the KV transfer's too), then
``stream_idle_timeout_s`` between chunks; an answer has no total deadline. Whenever a request
ends before its final chunk (client gone, deadline, decode worker lost or restarted, buffer
overflow, gateway stopping) it publishes ``Abort(transfer_id, sender=gateway_id)`` to P (when P
takes part) and to D; after a worker error, to P only.

Threading model: runs in a request handler on the gateway's loop. aiohttp cancels a handler
whose client disconnected (``handler_cancellation=True``); the ``finally`` of ``run`` then
hands the abort to a tracked background task, so it is sent although the handler is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import nats.errors
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from kvpush.schemas import subjects
from kvpush.schemas.messages import FinishReason, RequestEvent, Timing, TokenChunk
from kvpush.services.gateway import openai_api as api
from kvpush.services.gateway.observe import FinishedRequest
from kvpush.services.gateway.routing import NoWorkerError, first_token_by
from kvpush.services.gateway.streaming import StreamFailed

if TYPE_CHECKING:
    from kvpush.connector import Bus
    from kvpush.services.gateway.config import GatewayConfig
    from kvpush.services.gateway.metrics import GatewayMetrics
    from kvpush.services.gateway.model import ModelInfo
    from kvpush.services.gateway.observe import Observer
    from kvpush.services.gateway.routing import Route, Router
    from kvpush.services.gateway.streaming import TokenStreams

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvpush.gateway")
_json = msgspec.json.Encoder()
LIVENESS_POLL_S = 0.5  # how often a waiting request checks that its decode worker lives


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class FlowHost(Protocol):
    """What a flow needs of the gateway (``handlers.GatewayApi`` is the one implementation)."""

    config: GatewayConfig
    model: ModelInfo
    bus: Bus
    router: Router
    streams: TokenStreams
    metrics: GatewayMetrics
    observer: Observer
    spawn: Callable[[Awaitable[None]], None]

    async def tokenize(self, parsed: api.ParsedRequest) -> list[int]: ...

    async def abort(self, route: Route, transfer_id: str, reason: str, *, decode: bool) -> None: ...


class RequestFlow:
    """One generation request from parsed body to last byte; see the module docstring."""

    def __init__(
        self, gw: FlowHost, request: web.Request, endpoint: api.Endpoint, span: Span
    ) -> None:
        self.gw, self.request, self.endpoint, self.span = gw, request, endpoint, span
        self.loop = asyncio.get_running_loop()
        self.arrived = self.loop.time()
        self.arrived_ns = time.time_ns()
        self.published_ns = self.first_byte_ns = self.last_chunk_ns = 0
        self.worker_timing: Timing | None = None  # from the last TokenChunk
        self.status = "client disconnected"
        self.first_at: float | None = None
        self.ended = False  # D reported the end (final chunk or error): nothing to abort on D
        self.worker_error = False  # ... with an error: P may still be working, abort it
        self.abort_reason = "client disconnected"
        self.completion_tokens = 0

    async def run(self) -> web.StreamResponse:
        gw, config = self.gw, self.gw.config
        parsed = api.parse_request(self.endpoint, await self.request.read())
        if parsed.model is not None and parsed.model != gw.model.served_name:
            raise api.ApiError(
                404,
                f"The model `{parsed.model[:200]}` does not exist.",
                param="model",
                code="model_not_found",
            )
        ids = await gw.tokenize(parsed)
        sampling = api.sampling_spec(parsed, len(ids), gw.model.max_model_len)
        with _tracer.start_as_current_span("gateway.route"):
            try:
                route = gw.router.route(len(ids), parsed.mode)
            except NoWorkerError as exc:
                raise api.ApiError(
                    503, str(exc), type_="service_unavailable", code="no_workers"
                ) from None
        prefix = "chatcmpl" if self.endpoint is api.Endpoint.CHAT else "cmpl"
        request_id, transfer_id = f"{prefix}-{uuid.uuid4().hex}", secrets.token_urlsafe(16)
        self.deadline = self.arrived + config.request_timeout_s
        event = RequestEvent(
            transfer_id=transfer_id,
            request_id=request_id,
            prefill_id=route.prefill_id,
            decode_id=route.decode_id,
            model=gw.model.served_name,
            prompt_token_ids=ids,
            reply_subject=gw.streams.subject,
            deadline_ms=int((time.time() + config.request_timeout_s) * 1000),
            sampling=sampling,
            mode=route.mode,
            stream=parsed.stream,
            first_token_by=first_token_by(config.first_token, route, sampling),
        )
        self.route, self.parsed, self.prompt_tokens = route, parsed, len(ids)
        self.span.set_attributes(
            {
                "gen_ai.request.model": gw.model.served_name,
                "gen_ai.request.max_tokens": sampling.max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.usage.input_tokens": len(ids),
                "kvpush.request_id": request_id,
                "kvpush.transfer_id": transfer_id,
                "kvpush.mode": route.mode.value,
                "kvpush.prefill_id": route.prefill_id,
                "kvpush.decode_id": route.decode_id,
            }
        )
        log.debug("request %s transfer %s -> %s", request_id, transfer_id, route)
        self.shaper = api.Shaper(
            self.endpoint,
            request_id,
            int(time.time()),
            gw.model.served_name,
            include_usage=parsed.include_usage,
        )
        self.stream = gw.streams.open(request_id, transfer_id)
        self.first_byte = _tracer.start_span("gateway.first_byte")
        try:
            await self._publish(event)
            self.published_ns = time.time_ns()
            gw.observer.track(transfer_id, route.mode.value)
            gw.metrics.routed.labels(route.mode.value).inc()
            gw.metrics.prompt_tokens.inc(len(ids))
            if parsed.stream:
                return await self._stream()
            return await self._collect()
        finally:
            gw.streams.close(request_id)
            if self.first_at is None:
                self.first_byte.end()
            gw.metrics.completion_tokens.inc(self.completion_tokens)
            self.span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
            if not self.ended:
                gw.metrics.aborts.labels(self.abort_reason.split(":")[0]).inc()
                self.span.set_status(StatusCode.ERROR, self.abort_reason)
                log.info("aborting %s (%s): %s", request_id, transfer_id, self.abort_reason)
                gw.spawn(gw.abort(route, transfer_id, self.abort_reason, decode=True))
            elif self.worker_error and route.prefill_epoch is not None:
                gw.spawn(gw.abort(route, transfer_id, "decode worker error", decode=False))
            gw.observer.finished(self._finished(request_id, transfer_id))

    def _finished(self, request_id: str, transfer_id: str) -> FinishedRequest:
        context = self.span.get_span_context()
        ok = self.ended and not self.worker_error
        return FinishedRequest(
            request_id=request_id,
            transfer_id=transfer_id,
            trace_id=f"{context.trace_id:032x}" if context.trace_id else "",
            mode=self.route.mode.value,
            status="ok" if ok else (self.status if self.ended else self.abort_reason),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            arrived_ns=self.arrived_ns,
            published_ns=self.published_ns,
            first_byte_ns=self.first_byte_ns,
            last_chunk_ns=self.last_chunk_ns,
            worker_timing=self.worker_timing,
        )

    def _first_byte(self) -> None:
        """The first token goes to the client now (stream) or is here (stream=false)."""
        if self.first_at is not None:
            return
        self.first_at = self.loop.time()
        self.first_byte_ns = time.time_ns()
        self.first_byte.end()
        self.gw.metrics.ttft.labels(self.route.mode.value).observe(self.first_at - self.arrived)

    async def _publish(self, event: RequestEvent) -> None:
        try:
            await self.gw.bus.publish(subjects.request(event.prefill_id, event.decode_id), event)
        except nats.errors.MaxPayloadError:
            raise api.ApiError(413, "the prompt is too large for the message bus") from None
        except (nats.errors.Error, OSError) as exc:
            log.warning("publish of %s failed: %r", event.request_id, exc)
            raise api.ApiError(
                503, "the message bus is unavailable", type_="service_unavailable"
            ) from None

    async def _next(self) -> TokenChunk:
        """The next chunk in order, or ApiError: 504 deadline, 502 worker lost, 503 overflow."""
        while True:
            remaining = self.deadline - self.loop.time()
            if remaining <= 0:
                self.abort_reason = "deadline"
                config = self.gw.config
                if self.completion_tokens:
                    why = f"no token for {config.stream_idle_timeout_s:g} s"
                else:
                    why = f"no first token after {config.request_timeout_s:g} s"
                raise api.ApiError(
                    504, f"request timed out: {why}", type_="timeout", code="timeout"
                )
            try:
                chunk = await self.stream.next(min(remaining, LIVENESS_POLL_S))
            except asyncio.TimeoutError:
                if not self.gw.router.still_serving(self.route):
                    self.abort_reason = "decode worker lost"
                    message = f"decode worker {self.route.decode_id} was lost or restarted"
                    raise api.ApiError(502, message, type_="worker_error") from None
                continue
            except StreamFailed as exc:
                self.abort_reason = f"stream failed: {exc}"
                raise api.ApiError(503, str(exc), type_="service_unavailable") from None
            if not self.parsed.stream:
                self._first_byte()
            # no total deadline: from the first token on, only the gap between tokens counts
            self.deadline = self.loop.time() + self.gw.config.stream_idle_timeout_s
            self.completion_tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                self.last_chunk_ns = time.time_ns()
                self.worker_timing = chunk.timing
            if chunk.error is not None or chunk.finish_reason is FinishReason.ERROR:
                self.ended = self.worker_error = True
                why = chunk.error or "unspecified"
                self.status = f"worker error: {why}"[:200]
                self.span.set_status(StatusCode.ERROR, f"worker error: {why}")
                raise api.ApiError(502, f"worker error: {why}", type_="worker_error")
            if chunk.finish_reason is not None:
                self.ended = True
                self.gw.metrics.e2e.labels(self.route.mode.value).observe(
                    self.loop.time() - self.arrived
                )
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
            return chunk

    def _usage(self) -> dict[str, int]:
        return api.usage_body(self.prompt_tokens, self.completion_tokens)

    async def _collect(self) -> web.Response:
        texts: list[str] = []
        while True:
            chunk = await self._next()
            texts.append(chunk.text)
            if chunk.finish_reason is not None:
                break
        self.span.set_attribute("gen_ai.response.finish_reasons", [chunk.finish_reason.value])
        body = self.shaper.response("".join(texts), chunk.finish_reason.value, self._usage())
        response = json_response(body)
        response.headers["X-Request-Id"] = self.shaper.request_id
        return response

    async def _stream(self) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        first = True
        try:
            while True:
                try:
                    chunk = await self._next()
                except api.ApiError as exc:
                    if response is None:
                        raise
                    await self._send(response, exc.body())
                    break
                if response is None:
                    response = web.StreamResponse(
                        headers={
                            "Content-Type": "text/event-stream",
                            "Cache-Control": "no-cache",
                            "X-Request-Id": self.shaper.request_id,
                        }
                    )
                    await response.prepare(self.request)
                finish = chunk.finish_reason.value if chunk.finish_reason else None
                if chunk.text or chunk.token_ids or finish:
                    await self._send(response, self.shaper.chunk(chunk.text, finish, first=first))
                    first = False
                self._first_byte()
                if finish:
                    self.span.set_attribute("gen_ai.response.finish_reasons", [finish])
                    if self.parsed.include_usage:
                        await self._send(response, self.shaper.usage_chunk(self._usage()))
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:  # the client went away while we wrote
            self.abort_reason = "client disconnected"
        return response if response is not None else web.Response(status=499)

    @staticmethod
    async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
        await response.write(b"data: " + _json.encode(body) + b"\n\n")
