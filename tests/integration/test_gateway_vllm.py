"""The gateway's vLLM frontend (``--frontend vllm``) against fake workers: what the parity suite
cannot show because ``vllm serve`` has no P and D. A worker error before any token is a 502 (not
a 200 stream), after the first chunk an error event then ``[DONE]``; a deadline is a 504;
nothing stays in flight (a client gone mid-stream: test_gateway_faults, both frontends). The
model folder is the tiny model's (vLLM's serving layer reads its config).

Threading model: the test's event loop (gateway and fake workers on it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvpush.connector import Bus
from kvpush.schemas.messages import FinishReason, RequestEvent, TokenChunk
from kvpush.services.natsd import EmbeddedNats
from tests.integration.gateway_fakes import Stack, Stacks, chunk, sse_events, wait_until

StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def vstack(bus: Bus, tiny_model: Path, nats_server: EmbeddedNats) -> AsyncIterator[Any]:
    async with Stacks(bus, tiny_model, nats_server.url) as make:

        async def vllm_stack(**overrides: Any) -> Stack:
            return await make(frontend="vllm", local_threshold=0, **overrides)

        yield vllm_stack


def failing_after(text: str) -> Callable[[RequestEvent], list[TokenChunk]]:
    def reply(event: RequestEvent) -> list[TokenChunk]:
        head = [chunk(event, 0, text)] if text else []
        return [*head, chunk(event, len(head), error="boom", finish_reason=FinishReason.ERROR)]

    return reply


async def test_worker_errors_are_502_before_any_token_and_an_error_event_after(
    vstack: StackFactory,
) -> None:
    s = await vstack(reply=failing_after(""))
    for stream in (False, True):
        status, answer = await s.post("/v1/completions", {"prompt": "x", "stream": stream})
        assert status == 502 and answer["error"]["message"] == "worker error: boom", answer
    s.decode.reply = failing_after("partial")
    status, text = await s.post("/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200
    events = sse_events(text)
    assert events[0]["choices"][0]["text"] == "partial"
    assert "boom" in json.dumps(events[-1]["error"])
    await wait_until(lambda: len(s.prefill.aborts) == 3)  # P may still be working: abort it
    assert not s.decode.aborts and s.gateway.in_flight == 0


async def test_a_deadline_is_504_and_aborts_p_and_d(vstack: StackFactory) -> None:
    s = await vstack(reply=None, request_timeout_s=1.0)
    status, answer = await s.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 504 and answer["error"]["code"] == "timeout", answer
    await wait_until(lambda: bool(s.prefill.aborts and s.decode.aborts))
    assert s.decode.aborts[0].reason == "deadline" and s.gateway.in_flight == 0


async def test_a_whole_answer_joins_the_worker_s_chunks(vstack: StackFactory) -> None:
    s = await vstack()
    status, answer = await s.post("/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 200, answer
    assert answer["choices"][0]["text"] == " w0 w1 w2"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 3


async def test_the_openapi_document_describes_vllm_s_routes_and_kvpush_s_own(
    vstack: StackFactory,
) -> None:
    import schemathesis

    s = await vstack(api_keys=("k",))
    status, doc = await s.call("GET", "/openapi.json")
    assert status == 200
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    request = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    ref = request["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    fields = doc["components"]["schemas"][ref]["properties"]
    assert {"n", "logprobs", "echo", "response_format", "structured_outputs"} <= set(fields)
    assert {"/tokenize", "/detokenize", "/version", "/dashboard", "/ready"} <= set(doc["paths"])
    assert doc["paths"]["/v1/completions"]["post"]["security"]  # API keys on /v1/*
    assert "security" not in doc["paths"]["/tokenize"]["post"]


async def test_a_client_s_x_request_id_names_the_answer_and_comes_back(
    vstack: StackFactory,
) -> None:
    s = await vstack()
    headers = {"X-Request-Id": "client-42"}
    for stream in (False, True):
        body = {"prompt": "x", "max_tokens": 2, "stream": stream}
        async with s.http.post(
            s.gateway.url + "/v1/completions", json=body, headers=headers
        ) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "client-42"
            text = await resp.text()
        first = sse_events(text)[0] if stream else json.loads(text)
        assert first["id"] == "cmpl-client-42"
    # the bus, the traces and the dashboard know the request by the answer's id
    assert [e.request_id for e in s.decode.events] == ["cmpl-client-42"] * 2


async def test_two_answers_at_once_under_one_x_request_id_both_come(vstack: StackFactory) -> None:
    s = await vstack()
    s.decode.chunk_delay_s = 0.02
    headers = {"X-Request-Id": "same"}
    body = {"prompt": "x", "max_tokens": 5}
    answers = await asyncio.gather(
        *(s.post("/v1/completions", body, headers=headers) for _ in range(2))
    )
    assert [status for status, _ in answers] == [200, 200]
    assert all(a["choices"][0]["text"] == " w0 w1 w2 w3 w4" for _, a in answers)
    ids = sorted(e.request_id for e in s.decode.events)
    assert ids[0] == "cmpl-same" and ids[1].startswith("cmpl-same-") and len(set(ids)) == 2
