"""Gateway faults over HTTP against fake workers: errors, auth, bounds, deadlines, lost workers,
aborts, SIGTERM, CORS.

Threading model: the test's event loop (gateway and fake workers on it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kvpush.schemas.messages import FinishReason, Usage
from kvpush.services.gateway import add_arguments, serve
from kvpush.services.natsd import EmbeddedNats
from tests.integration.gateway_fakes import (
    Reply,
    Stack,
    chunk,
    sse_events,
    wait_until,
)

StackFactory = Callable[..., Awaitable[Stack]]


async def test_errors_are_openai_json_with_the_right_status(stack: StackFactory) -> None:
    s = await stack(max_model_len=64)
    cases: list[tuple[str, str, Any, int, str | None]] = [
        ("POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, None),
        ("POST", "/v1/completions", {"prompt": "x", "logprobs": 1000}, 400, None),
        ("POST", "/v1/completions", {"prompt": list(range(1, 66))}, 400, None),  # 65 > 64
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "wizard", "content": "x"}]},
            400,
            None,
        ),
        ("POST", "/v1/nothing", {}, 404, None),
        ("GET", "/v1/completions", None, 405, None),
    ]
    for method, path, body, want, code in cases:
        status, answer = await s.call(method, path, body)
        assert status == want, (path, body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert code is None or answer["error"]["code"] == code
    status, answer = await s.post("/v1/completions", None, data=b"{not json")
    assert status == 400 and "JSON" in answer["error"]["message"]
    status, answer = await s.post("/v1/completions", {"prompt": "x" * 5000})  # > 4096 bytes
    assert status == 413 and "too large" in answer["error"]["message"]
    status, answer = await s.post("/v1/completions", {"prompt": list(range(1, 65))})
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer  # no room left
    # as `vllm serve`: max_tokens past the context is clamped to what is left (64 - 59)
    fits = {"prompt": list(range(1, 60)), "max_tokens": 10}
    assert (await s.post("/v1/completions", fits))[0] == 200
    [event] = s.decode.events  # nothing invalid was published
    assert event.sampling.max_tokens == 5


async def test_api_keys_guard_v1_but_not_health(stack: StackFactory) -> None:
    s = await stack(api_keys=("k1", "k2"))
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k2"}):
        status, answer = await s.post("/v1/completions", body, headers=headers)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert (await s.call("GET", "/v1/models"))[0] == 401
    status, _ = await s.post("/v1/completions", body, headers={"Authorization": "Bearer k2"})
    assert status == 200
    assert (await s.call("GET", "/health"))[0] == 200
    assert (await s.call("GET", "/ready"))[0] == 200


async def test_inflight_bound_is_429_and_deadline_is_504_with_aborts_to_p_and_d(
    stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvpush.services.gateway.bus_generation")
    s = await stack(
        reply=None, max_inflight=1, max_queued=0, request_timeout_s=1.0, local_threshold=0
    )
    first = asyncio.create_task(s.post("/v1/completions", {"prompt": "x"}))
    await wait_until(lambda: len(s.decode.events) == 1)
    status, answer = await s.post("/v1/completions", {"prompt": "y"})
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded"
    status, answer = await first
    assert status == 504 and answer["error"]["type"] == "timeout"
    transfer = s.decode.events[0].transfer_id
    # the log names the request, its transfer and its route (the 504 body does not)
    (logged,) = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert transfer in logged and "no first token after 1 s" in logged and "decode " in logged
    await wait_until(lambda: bool(s.prefill.aborts and s.decode.aborts))
    for abort in (s.prefill.aborts[0], s.decode.aborts[0]):
        assert abort.transfer_id == transfer and abort.reason == "deadline"
        assert abort.sender == s.gateway.config.gateway_id
    assert s.gateway.in_flight == 0


async def test_a_lost_decode_worker_fails_its_requests_with_502(stack: StackFactory) -> None:
    s = await stack(reply=None, local_threshold=0)
    pending = asyncio.create_task(s.post("/v1/completions", {"prompt": "x"}))
    await wait_until(lambda: len(s.decode.events) == 1)
    s.decode.beating = False
    status, answer = await pending
    # the lease ended it: the request's deadline would have answered 504 "timeout"
    assert status == 502 and "lost" in answer["error"]["message"], answer
    await wait_until(lambda: bool(s.prefill.aborts))


def positional_reply(event: Any) -> list[Any]:
    """Token ``1000 + p`` (text " t<p>") at each answer position p: a continuation from a longer
    prompt (a migration's) goes on where the lost worker stopped."""
    start, n = len(event.prompt_token_ids), event.sampling.max_tokens
    chunks = [chunk(event, i, f" t{start + i}") for i in range(n)]
    chunks = [
        msgspec.structs.replace(c, token_ids=[1000 + start + i]) for i, c in enumerate(chunks)
    ]
    usage = Usage(prompt_tokens=start, completion_tokens=n)
    last = msgspec.structs.replace(chunks[-1], finish_reason=FinishReason.LENGTH, usage=usage)
    return [*chunks[:-1], last]


async def test_a_decode_worker_lost_mid_answer_hands_the_request_to_another(
    stack: StackFactory,
) -> None:
    s = await stack(decode=("d", "e"), reply=positional_reply, local_threshold=0)
    decoders = [w for w in s.workers if w.reply is not None]
    body = {"prompt": "x", "max_tokens": 30, "stream": True}
    status, text = await s.post("/v1/completions", body)
    assert status == 200
    unbroken = "".join(e["choices"][0]["text"] for e in sse_events(text) if e["choices"])
    for worker in decoders:
        worker.chunk_delay_s = 0.05
    before = [len(w.events) for w in decoders]
    pending = asyncio.create_task(
        s.post("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    )
    await wait_until(lambda: sum(len(w.events) for w in decoders) == sum(before) + 1)
    lost, other = decoders if len(decoders[0].events) > before[0] else decoders[::-1]
    await asyncio.sleep(0.3)  # some tokens reach the client
    lost.beating = False  # "killed": silent, and sends nothing more
    for task in lost._tasks.values():
        task.cancel()
    status, text = await pending
    assert status == 200, text
    events = sse_events(text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == unbroken
    assert events[-1]["usage"]["completion_tokens"] == 30, events[-1]
    moved = other.events[-1]
    sent = len(moved.prompt_token_ids) - len(lost.events[-1].prompt_token_ids)
    assert 0 < sent < 30 and moved.sampling.max_tokens == 30 - sent
    scraped = (await s.call("GET", "/metrics"))[1]
    assert 'kvpush_gateway_migrations_total{lost="decode"} 1.0' in scraped


def failing_reply(text: str) -> Reply:
    def reply(event: Any) -> list[Any]:
        head = [chunk(event, 0, text)] if text else []
        return [*head, chunk(event, len(head), error="boom", finish_reason=FinishReason.ERROR)]

    return reply


async def test_worker_errors_are_502_before_any_token_and_an_error_event_after(
    stack: StackFactory,
) -> None:
    s = await stack(reply=failing_reply(""), local_threshold=0)
    for stream in (False, True):
        status, answer = await s.post("/v1/completions", {"prompt": "x", "stream": stream})
        assert status == 502 and answer["error"]["message"] == "worker error: boom", answer
        assert answer["error"]["type"] == "worker_error"
    s.decode.reply = failing_reply("partial")
    status, answer = await s.post("/v1/completions", {"prompt": "x"})
    assert status == 502 and answer["error"]["message"] == "worker error: boom", answer
    status, text = await s.post("/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200
    events = sse_events(text)
    assert events[0]["choices"][0]["text"] == "partial"
    assert "worker error: boom" in json.dumps(events[-1]["error"]) and len(events) == 2
    await wait_until(lambda: len(s.prefill.aborts) == 4)  # P may still be working: abort it
    assert not s.decode.aborts and s.gateway.in_flight == 0  # D ended the request itself


async def test_client_disconnect_mid_stream_aborts_p_and_d(stack: StackFactory) -> None:
    s = await stack(local_threshold=0)
    s.decode.chunk_delay_s = 0.05
    body = {"prompt": "x", "max_tokens": 200, "stream": True}
    async with s.http.post(s.gateway.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen == 2:
                break
        resp.close()  # drop the connection mid-stream
    transfer = s.decode.events[0].transfer_id
    await wait_until(lambda: bool(s.prefill.aborts and s.decode.aborts), 3.0)
    assert s.prefill.aborts[0].transfer_id == s.decode.aborts[0].transfer_id == transfer
    assert s.decode.aborts[0].sender == s.gateway.config.gateway_id
    await wait_until(lambda: s.gateway.in_flight == 0 and len(s.gateway.streams) == 0)


async def test_an_internal_error_is_a_bare_500(stack: StackFactory, monkeypatch: Any) -> None:
    s = await stack()

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail")

    monkeypatch.setattr(s.gateway.router, "route", explode)
    status, answer = await s.post("/v1/completions", {"prompt": "x"})
    assert status == 500 and answer["error"]["message"] == "internal server error"
    assert "secret" not in json.dumps(answer) and s.gateway.in_flight == 0


async def test_sigterm_drains_in_flight_requests_then_serve_returns_0(
    stack: StackFactory, model_dir: Path, nats_server: EmbeddedNats
) -> None:
    workers = await stack()  # fake P and D (and a gateway this test does not use)
    workers.decode.chunk_delay_s = 0.05
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--nats-url",
            nats_server.url,
            "--worker-lease-s",
            "0.5",
        ]
    )
    served = asyncio.create_task(serve(args))
    url = f"http://127.0.0.1:{port}"
    http = workers.http

    async def get_ready() -> int:
        try:
            async with http.get(url + "/ready") as resp:
                return resp.status
        except aiohttp.ClientConnectionError:
            return -1

    deadline = time.monotonic() + 10
    while await get_ready() != 200:
        assert time.monotonic() < deadline and not served.done()
        await asyncio.sleep(0.05)
    body = {"prompt": "x", "max_tokens": 20}
    slow = asyncio.create_task(http.post(url + "/v1/completions", json=body))
    await wait_until(lambda: len(workers.decode.events) == 1)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 3
    while await get_ready() != 503:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    async with http.post(url + "/v1/completions", json=body) as late:
        assert late.status == 503
    async with await slow as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"].endswith(" w19")
    assert await asyncio.wait_for(served, 10) == 0


async def _status_and_retry_after(s: Stack, body: dict[str, Any]) -> tuple[int, str | None, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{s.gateway.url}/v1/completions", json=body) as resp,
    ):
        return resp.status, resp.headers.get("Retry-After"), await resp.json()


async def test_past_max_inflight_requests_queue_then_429_or_503_with_retry_after(
    stack: StackFactory,
) -> None:
    s = await stack(
        reply=None, max_inflight=1, max_queued=1, request_timeout_s=1.0, local_threshold=0
    )
    first = asyncio.create_task(_status_and_retry_after(s, {"prompt": "a"}))
    await wait_until(lambda: len(s.decode.events) == 1)
    queued = asyncio.create_task(_status_and_retry_after(s, {"prompt": "b"}))
    await wait_until(lambda: s.gateway.api.admission.waiting == 1)
    status, retry_after, answer = await _status_and_retry_after(s, {"prompt": "c"})
    assert status == 429 and retry_after == "1", answer  # past both bounds: at once
    assert answer["error"]["code"] == "rate_limit_exceeded"
    assert (await first)[0] == 504  # nobody answers (reply=None): its deadline
    await wait_until(lambda: len(s.decode.events) == 2)  # the queued one, once the slot freed
    assert (await queued)[0] == 504
    short = await stack(
        share=s,
        reply=None,
        max_inflight=1,
        queue_timeout_s=0.3,
        request_timeout_s=2.0,
        local_threshold=0,
    )
    first = asyncio.create_task(_status_and_retry_after(short, {"prompt": "a"}))
    await wait_until(lambda: len(s.decode.events) == 3)
    status, retry_after, answer = await _status_and_retry_after(short, {"prompt": "b"})
    assert status == 503 and retry_after == "1" and answer["error"]["code"] == "queue_timeout"
    assert len(s.decode.events) == 3  # never published
    assert (await first)[0] == 504
    assert s.gateway.in_flight == 0 and short.gateway.in_flight == 0


async def test_cors_only_for_allowed_origins_preflight_and_streams_included(
    stack: StackFactory,
) -> None:
    s = await stack(allowed_origins=("https://app.example",), api_keys=("k",))
    url, allowed = f"{s.gateway.url}/v1/completions", {"Origin": "https://app.example"}
    key = {"Authorization": "Bearer k"}
    preflight = {**allowed, "Access-Control-Request-Method": "POST"}
    async with aiohttp.ClientSession() as http:
        async with http.options(url, headers=preflight) as resp:  # no API key: a preflight
            assert resp.status == 204
            assert "POST" in resp.headers["Access-Control-Allow-Methods"]
            assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        for stream in (False, True):
            body = {"prompt": "x", "stream": stream}
            async with http.post(url, json=body, headers={**allowed, **key}) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = {"Origin": "https://evil.example", **key}
        async with http.post(url, json={"prompt": "x"}, headers=other) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    plain = await stack(share=s)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{plain.gateway.url}/v1/completions", json={"prompt": "x"}, headers=allowed
        ) as resp,
    ):
        assert "Access-Control-Allow-Origin" not in resp.headers  # off by default
