"""The soak's HTTP client against a scripted server, its token-chunk assembly, and its gate."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web

from kvpush.benchmarks.soak import client
from kvpush.benchmarks.soak.checks import Delivery
from kvpush.benchmarks.soak.observer import SoakObserver
from kvpush.benchmarks.soak.run import Gate
from kvpush.schemas.messages import FinishReason, RequestEvent, Timing, TokenChunk
from tests.http_server import serving_completions

ERROR = {"message": "no decode worker is available", "type": "service_unavailable",
         "param": None, "code": "no_workers"}  # fmt: skip


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


SCRIPTS = {
    "ok": (200, "text/event-stream", sse({"choices": [{"text": "a "}]},
                                         {"choices": [{"text": "b"}]}, b"[DONE]")),
    "cut": (200, "text/event-stream", sse({"choices": [{"text": "a "}]})),
    "midway": (200, "text/event-stream", sse({"choices": [{"text": "a"}]},
                                             {"error": {**ERROR, "type": "worker_error",
                                                        "code": None}}, b"[DONE]")),
    "openai": (503, "application/json", json.dumps({"error": ERROR}).encode()),
    "bare": (500, "text/plain", b"Internal Server Error"),
    "nonopenai": (502, "application/json", json.dumps({"detail": "x"}).encode()),
    "unnamed": (200, "text/event-stream", sse({"id": "cmpl-7", "choices": [{"text": "a"}]},
                                              b"[DONE]")),
    "json": (200, "application/json", json.dumps({"id": "cmpl-9",
                                                  "choices": [{"text": "a b"}]}).encode()),
}  # fmt: skip


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    status, kind, payload = SCRIPTS[body["prompt"]]
    if kind != "text/event-stream":
        return web.Response(status=status, body=payload, content_type=kind.split(";")[0])
    named = {} if body["prompt"] == "unnamed" else {"X-Request-Id": "cmpl-1"}
    response = web.StreamResponse(headers={"Content-Type": kind, **named})
    await response.prepare(request)
    await response.write(payload)
    return response


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with serving_completions(completions) as base_url:
        yield base_url


async def ask(url: str, script: str, delivery: Delivery) -> client.Answer:
    async with client.session() as http:
        return await client.send(http, url, script, None, delivery, model="m", max_tokens=2)


async def test_a_stream_read_to_done_gives_its_whole_text(url: str) -> None:
    answer = await ask(url, "ok", Delivery.STREAM)
    assert (answer.status, answer.text, answer.request_id, answer.problem) == (
        200, "a b", "cmpl-1", ""
    )  # fmt: skip


async def test_an_abort_keeps_the_first_event_only(url: str) -> None:
    answer = await ask(url, "ok", Delivery.ABORT)
    assert answer.text == "a " and not answer.problem


async def test_a_stream_without_done_is_a_problem(url: str) -> None:
    assert "without [DONE]" in (await ask(url, "cut", Delivery.STREAM)).problem


async def test_an_error_event_in_a_stream_is_an_error(url: str) -> None:
    answer = await ask(url, "midway", Delivery.STREAM)
    assert answer.error is not None and answer.error.status == 502 and answer.error.in_stream


async def test_error_bodies_must_be_openai_json(url: str) -> None:
    answer = await ask(url, "openai", Delivery.JSON)
    assert answer.error is not None and answer.error.code == "no_workers"
    assert "not JSON" in (await ask(url, "bare", Delivery.JSON)).problem
    assert "not an OpenAI error body" in (await ask(url, "nonopenai", Delivery.JSON)).problem


async def test_a_json_answer_takes_its_id_from_the_body(url: str) -> None:
    answer = await ask(url, "json", Delivery.JSON)
    assert (answer.text, answer.request_id) == ("a b", "cmpl-9")


async def test_a_stream_without_a_request_id_header_is_named_by_its_events(url: str) -> None:
    for delivery in (Delivery.STREAM, Delivery.ABORT):
        answer = await ask(url, "unnamed", delivery)
        assert answer.request_id == "cmpl-7" and answer.text == "a"


async def test_a_refused_connection_is_a_problem() -> None:
    answer = await ask("http://127.0.0.1:9", "ok", Delivery.JSON)
    assert answer.status == 0 and answer.problem.startswith("client:")


def chunk(
    seq: int, ids: list[int], final: bool = False, landed: int = 0, transfer: str = "t1",
    cached: int = 0,
) -> TokenChunk:  # fmt: skip
    return TokenChunk(
        request_id="r1", transfer_id=transfer, seq=seq, token_ids=ids,
        finish_reason=FinishReason.LENGTH if final else None,
        timing=Timing(kv_landed=landed, kv_cached=cached) if final else None,
    )  # fmt: skip


def request(transfer: str, prompt: list[int], decode: str = "soak-d0") -> RequestEvent:
    return RequestEvent(
        transfer_id=transfer, request_id="r1", prefill_id="soak-p0", decode_id=decode,
        model="m", prompt_token_ids=prompt, reply_subject="kvpush.v1.tokens.soak-gw",
        deadline_ms=0,
    )  # fmt: skip


async def test_the_observer_assembles_chunks_in_seq_order_and_knows_the_route() -> None:
    watch = SoakObserver(None, "soak-gw")  # type: ignore[arg-type]
    await watch._on_request("s", request("t1", [1]))
    await watch._on_chunk("s", chunk(1, [7]))
    await watch._on_chunk("s", chunk(2, [8], final=True, landed=5))
    partial = await watch.observed("r1", 0.0)
    assert partial is not None and partial.token_ids == () and not partial.complete
    await watch._on_request("s", request("t1", [1]))
    for c in (chunk(0, [6]), chunk(1, [7]), chunk(2, [8], final=True, landed=5)):
        await watch._on_chunk("s", c)
    whole = await watch.observed("r1", 1.0)
    assert whole is not None and whole.complete and whole.token_ids == (6, 7, 8)
    assert whole.mode == "push" and whole.kv_landed and whole.prompt_ids == (1,)
    assert whole.moves == 0
    assert await watch.observed("r1", 0.0) is None  # forgotten


async def test_the_observer_knows_a_prompt_d_held_in_its_prefix_cache() -> None:
    watch = SoakObserver(None, "soak-gw")  # type: ignore[arg-type]
    await watch._on_request("s", request("t1", [1]))
    await watch._on_chunk("s", chunk(0, [6], final=True, cached=5))
    held = await watch.observed("r1", 1.0)
    assert held is not None and held.complete and held.kv_cached and not held.kv_landed
    assert "soak-p0" not in watch.served  # P did nothing for it


async def test_chunks_without_their_request_event_are_never_complete() -> None:
    watch = SoakObserver(None, "soak-gw")  # type: ignore[arg-type]
    for c in (chunk(0, [6]), chunk(1, [7], final=True)):
        await watch._on_chunk("s", c)
    seen = await watch.observed("r1", 0.0)
    assert seen is not None and seen.token_ids == (6, 7) and not seen.complete
    assert seen.mode is None


async def test_a_moved_request_is_observed_by_its_last_transfer() -> None:
    watch = SoakObserver(None, "soak-gw")  # type: ignore[arg-type]
    await watch._on_request("s", request("t1", [1, 2]))
    await watch._on_chunk("s", chunk(0, [6], transfer="t1"))  # then soak-d0 died
    await watch._on_request("s", request("t2", [1, 2, 6], decode="soak-d1"))
    await watch._on_chunk("s", chunk(0, [7], transfer="t2"))
    await watch._on_chunk("s", chunk(1, [8], final=True, landed=3, transfer="t2"))
    seen = await watch.observed("r1", 1.0)
    assert seen is not None and seen.complete and seen.moves == 1
    assert seen.prompt_ids == (1, 2, 6) and seen.token_ids == (7, 8)
    assert seen.answer_ids((1, 2)) == (6, 7, 8)
    assert set(watch.served) == {"soak-d1", "soak-p0"}  # the answer's KV came from soak-p0


async def test_another_gateways_requests_are_not_observed() -> None:
    watch = SoakObserver(None, "soak-gw")  # type: ignore[arg-type]
    other = msgspec.structs.replace(request("t1", [1]), reply_subject="kvpush.v1.tokens.gw2")
    await watch._on_request("s", other)
    assert await watch.observed("r1", 0.0) is None


async def test_the_gate_waits_for_requests_in_flight_and_holds_new_ones() -> None:
    gate = Gate()
    await gate.enter()
    closing = asyncio.ensure_future(gate.close())
    await asyncio.sleep(0.05)
    assert not closing.done()
    entering = asyncio.ensure_future(gate.enter())
    gate.leave()
    await asyncio.wait_for(closing, 1.0)
    await asyncio.sleep(0.05)
    assert not entering.done() and gate.busy == 0
    gate.open()
    await asyncio.wait_for(entering, 1.0)
    assert gate.busy == 1
