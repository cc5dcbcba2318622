"""One generation request's flow under ``--frontend kvpush`` (kvpush's older parser), from body
bytes to the last byte sent (``RequestFlow``); the bus part is ``remote.RemoteGeneration``'s.

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

import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from aiohttp import web
from opentelemetry.trace import Span

from kvpush.services.gateway import openai_api as api
from kvpush.services.gateway import remote
from kvpush.services.gateway.openai_api import json_response
from kvpush.services.gateway.remote import RemoteGeneration, RequestContext

if TYPE_CHECKING:
    from kvpush.schemas.messages import TokenChunk
    from kvpush.services.gateway.model import ModelInfo

_json = msgspec.json.Encoder()


class FlowHost(remote.FlowHost, Protocol):
    """What a flow needs of the gateway (``handlers.GatewayApi`` is the one implementation)."""

    model: ModelInfo

    async def tokenize(self, parsed: api.ParsedRequest) -> list[int]: ...


class RequestFlow:
    """One generation request from parsed body to last byte; see the module docstring."""

    def __init__(
        self, gw: FlowHost, request: web.Request, endpoint: api.Endpoint, span: Span
    ) -> None:
        self.gw, self.request, self.endpoint = gw, request, endpoint
        self.context = RequestContext(span=span)

    async def run(self) -> web.StreamResponse:
        gw = self.gw
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
        prefix = "chatcmpl" if self.endpoint is api.Endpoint.CHAT else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.parsed, self.context.mode = parsed, parsed.mode
        self.shaper = api.Shaper(
            self.endpoint,
            request_id,
            int(time.time()),
            gw.model.served_name,
            include_usage=parsed.include_usage,
        )
        self.remote = RemoteGeneration(gw, self.context, request_id)
        try:
            await self.remote.start(ids, sampling, parsed.stream)
            return await (self._stream() if parsed.stream else self._collect())
        finally:
            self.remote.finish()

    def _usage(self) -> dict[str, int]:
        return api.usage_body(self.remote.prompt_tokens, self.remote.completion_tokens)

    async def _collect(self) -> web.Response:
        texts: list[str] = []
        chunk: TokenChunk | None = None
        while chunk is None or chunk.finish_reason is None:
            chunk = await self.remote.next()
            texts.append(chunk.text)
        assert chunk.finish_reason is not None
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
                    chunk = await self.remote.next()
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
                if finish:
                    if self.parsed.include_usage:
                        await self._send(response, self.shaper.usage_chunk(self._usage()))
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:  # the client went away while we wrote
            self.remote.abort_reason = "client disconnected"
        return response if response is not None else web.Response(status=499)

    @staticmethod
    async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
        await response.write(b"data: " + _json.encode(body) + b"\n\n")
