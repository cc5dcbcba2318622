"""One soak request over HTTP, read into an ``Answer`` with nothing judged yet.

``send`` posts a greedy ``/v1/completions`` request (``kvpush_mode`` when one is asked for)
and reads it the way its ``Delivery`` says: the JSON body (stream=false), the SSE stream to
``[DONE]``, or the first SSE event only, after which the client goes away (a client abort).
The answer's id (the request's id on the bus) is the ``X-Request-Id`` header, else the JSON
body's or the first stream event's ``id`` (the gateway sets the header on a stream only when
the client sent one).
Anything not in the OpenAI shapes the gateway promises becomes ``Answer.problem``: a non-JSON
or non-OpenAI error body, a 200 that is not JSON / not an event stream, an event that is not
``data: <json>``, a stream that ends without ``[DONE]``, a connection reset or a client
timeout (the gateway answers every request within its own deadline, well under the client's).
Every answer carries the seconds from sending to its end (``elapsed_s``: some errors must come
fast).

Each client has its own ``aiohttp`` session without keep-alive (``force_close``): a pause of
the load longer than the server's keep-alive must not turn into a reset on a reused connection.
Threading model: asyncio, on the soak's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import aiohttp

from kvpush.benchmarks.soak.checks import (
    Answer,
    Delivery,
    ErrorInfo,
    parse_error_body,
    stream_error,
)

CLIENT_TIMEOUT_S = 90.0


def session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True))


def _text_of(body: Any) -> str | None:
    try:
        text = body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


async def _error_answer(resp: aiohttp.ClientResponse, delivery: Delivery) -> Answer:
    raw = await resp.read()
    try:
        body = json.loads(raw)
    except ValueError:
        return Answer(delivery, resp.status, problem=f"{resp.status}: body is not JSON")
    error = parse_error_body(resp.status, body)
    if isinstance(error, str):
        return Answer(delivery, resp.status, problem=error)
    return Answer(delivery, resp.status, error=error)


async def _json_answer(resp: aiohttp.ClientResponse, request_id: str) -> Answer:
    try:
        body = json.loads(await resp.read())
    except ValueError:
        return Answer(Delivery.JSON, 200, request_id, problem="200: body is not JSON")
    text = _text_of(body)
    if text is None:
        return Answer(Delivery.JSON, 200, request_id, problem="200: no choices[0].text")
    return Answer(Delivery.JSON, 200, request_id or str(body.get("id", "")), text)


def _event(line: bytes) -> tuple[str, Any] | str:
    """("done", None), ("event", json) or a problem."""
    if not line.startswith(b"data: "):
        return f"stream line is not an SSE data event: {line[:40]!r}"
    payload = line[6:].strip()
    if payload == b"[DONE]":
        return "done", None
    try:
        return "event", json.loads(payload)
    except ValueError:
        return "stream event is not JSON"


async def _stream_answer(
    resp: aiohttp.ClientResponse, request_id: str, delivery: Delivery
) -> Answer:
    if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        return Answer(delivery, 200, request_id, problem="200 stream is not text/event-stream")
    texts: list[str] = []
    error: ErrorInfo | None = None
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        parsed = _event(line)
        if isinstance(parsed, str):
            return Answer(delivery, 200, request_id, problem=parsed)
        kind, event = parsed
        if kind == "done":
            if delivery is Delivery.ABORT and error is None and not texts:
                return Answer(delivery, 200, request_id, problem="stream ended before any event")
            return Answer(delivery, 200, request_id, "".join(texts), error)
        found = stream_error(event)
        if isinstance(found, str):
            return Answer(delivery, 200, request_id, problem=found)
        if found is not None:
            error = found
            continue  # the gateway sends [DONE] after an error event
        text = _text_of(event)
        if text is None:
            return Answer(delivery, 200, request_id, problem="stream event without choices[0].text")
        if not request_id and isinstance(event.get("id"), str):
            request_id = event["id"]  # the gateway names a stream only in its events
        texts.append(text)
        if delivery is Delivery.ABORT:
            return Answer(delivery, 200, request_id, text)  # leaving now closes the connection
    return Answer(delivery, 200, request_id, problem="stream ended without [DONE]")


async def send(
    client: aiohttp.ClientSession,
    url: str,
    prompt: str,
    mode: str | None,
    delivery: Delivery,
    *,
    model: str,
    max_tokens: int,
) -> Answer:
    """One request, read as ``delivery`` says, with the seconds it took (``elapsed_s``); see
    the module docstring."""
    started = time.monotonic()
    answer = await _send(client, url, prompt, mode, delivery, model=model, max_tokens=max_tokens)
    return dataclasses.replace(answer, elapsed_s=round(time.monotonic() - started, 3))


async def _send(
    client: aiohttp.ClientSession,
    url: str,
    prompt: str,
    mode: str | None,
    delivery: Delivery,
    *,
    model: str,
    max_tokens: int,
) -> Answer:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": delivery is not Delivery.JSON,
    }
    if mode is not None:
        body["kvpush_mode"] = mode
    try:
        async with client.post(f"{url}/v1/completions", json=body) as resp:
            request_id = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                return await _error_answer(resp, delivery)
            if delivery is Delivery.JSON:
                return await _json_answer(resp, request_id)
            return await _stream_answer(resp, request_id, delivery)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Answer(delivery, 0, problem=f"client: {type(exc).__name__}: {exc}"[:160])
