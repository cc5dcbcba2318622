"""The gateway over HTTP against fake prefill/decode workers on the real nats-server: vLLM's
serving layer in front, kvpush's routing, bus and streams behind it. What the parity suite
cannot show because ``vllm serve`` has no P and D: the RequestEvent each answer publishes, modes,
readiness, chunk order, two gateways on one bus, request ids on the bus. Faults are
``test_gateway_faults``'; fuzzing ``test_gateway_fuzz*``.

Threading model: the test's event loop (gateway and fake workers on it).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvpush.connector.bus import Bus
from kvpush.schemas.messages import FinishReason, TransferMode, WorkerRole
from kvpush.services.gateway.routing import DECODE_ONLY, RoutingPolicy
from tests.integration.gateway_fakes import (
    FakeWorker,
    Stack,
    chunk,
    sse_events,
    wait_until,
)

StackFactory = Callable[..., Awaitable[Stack]]


async def test_completion_answers_openai_json_and_publishes_one_event_to_p_and_d(
    stack: StackFactory, tokenizer: Any
) -> None:
    s = await stack()
    body = {
        "model": "kvpush-tiny",
        "prompt": "hello there world",
        "max_tokens": 4,
        "temperature": 0,
        "seed": 7,
        "stop": ["zz"],
        "ignore_eos": True,
        "min_tokens": 2,
    }
    before_ms = time.time() * 1000
    status, answer = await s.post("/v1/completions", body)
    assert status == 200, answer
    assert answer["object"] == "text_completion" and answer["model"] == "kvpush-tiny"
    assert re.fullmatch(r"cmpl-[0-9a-f]{16,32}", answer["id"]), answer["id"]
    [choice] = answer["choices"]
    assert (choice["index"], choice["text"]) == (0, " w0 w1 w2 w3")
    assert (choice["logprobs"], choice["finish_reason"]) == (None, "length")
    prompt_ids = tokenizer("hello there world")["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id
    assert {
        k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    } == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 4,
        "total_tokens": len(prompt_ids) + 4,
    }
    [event] = s.decode.events
    assert s.prefill.events == [event]  # one publish on req.<P>.<D> reached both
    assert (event.prefill_id, event.decode_id) == (s.prefill.worker_id, s.decode.worker_id)
    assert event.request_id == answer["id"] and event.prompt_token_ids == prompt_ids
    assert re.fullmatch(r"[A-Za-z0-9_-]{8,64}", event.transfer_id)
    assert event.reply_subject == f"kvpush.v1.tokens.{s.gateway.config.gateway_id}"
    assert event.model == "kvpush-tiny" and event.stream is False
    assert event.mode is TransferMode.LOCAL  # 4 tokens < local_threshold 256
    sampling = event.sampling
    assert (sampling.max_tokens, sampling.min_tokens, sampling.temperature) == (4, 2, 0.0)
    assert (sampling.seed, sampling.stop, sampling.ignore_eos) == (7, ["zz"], True)
    assert before_ms + 9_000 < event.deadline_ms < time.time() * 1000 + 10_500


async def test_chat_stream_sends_role_first_deltas_usage_and_done(
    stack: StackFactory, tokenizer: Any
) -> None:
    s = await stack()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = {
        "messages": messages,
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, text = await s.post("/v1/chat/completions", body)
    assert status == 200
    events = sse_events(text)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}  # vLLM's first chunk: the role
    assert [d["content"] for d in deltas[1:]] == [" w0", " w1", " w2"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, None, "length"]
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert expected.count(tokenizer.bos_token_id) == 1
    assert s.decode.events[0].prompt_token_ids == expected and s.decode.events[0].stream
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert events[-1]["usage"]["prompt_tokens"] == len(expected)


async def test_token_id_prompts_are_sent_verbatim_and_checked_against_the_vocab(
    stack: StackFactory,
) -> None:
    s = await stack()
    status, _ = await s.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1})
    assert status == 200 and s.decode.events[0].prompt_token_ids == [5, 6, 7]
    status, error = await s.post("/v1/completions", {"prompt": [5, 4096]})  # vocabulary: 2048
    assert status == 400 and "4096" in error["error"]["message"], error
    assert len(s.decode.events) == 1  # nothing invalid was published


async def test_short_prompts_go_local_long_ones_use_the_mode_and_requests_may_override(
    stack: StackFactory,
) -> None:
    # the fixed rule (routed's while it is cold and no D is idle: test_gateway_cost_model.py)
    s = await stack(local_threshold=8, routing=RoutingPolicy.LEAST_LOADED)
    long_prompt = list(range(1, 21))
    for body in (
        {"prompt": "hi"},
        {"prompt": long_prompt},
        {"prompt": long_prompt, "kvpush_mode": "pull"},
        {"prompt": "hi", "kvpush_mode": "push"},
    ):
        status, answer = await s.post("/v1/completions", {**body, "max_tokens": 1})
        assert status == 200, answer
    await asyncio.sleep(0.1)
    assert not s.prefill.aborts and not s.decode.aborts  # finished requests are not aborted
    modes = [e.mode for e in s.decode.events]
    assert modes == [TransferMode.LOCAL, TransferMode.PUSH, TransferMode.PULL, TransferMode.PUSH]
    pull = await stack(mode=TransferMode.PULL, local_threshold=0, share=s)
    assert (await pull.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}))[0] == 200
    assert s.decode.events[-1].mode is TransferMode.PULL


async def test_without_prefill_decode_serves_alone_unless_a_transfer_is_asked_for(
    stack: StackFactory,
) -> None:
    """A deployment without prefill workers (--required-roles decode: `kvpush up --prefill
    0`) is ready with D alone, which computes every prompt."""
    s = await stack(prefill=(), required_roles=(WorkerRole.DECODE,))
    status, ready = await s.call("GET", "/ready")
    assert status == 200 and ready["missing"] == [] and ready["workers"]["prefill"] == 0
    status, _ = await s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200
    assert s.decode.events[0].prefill_id == DECODE_ONLY
    assert s.decode.events[0].mode is TransferMode.LOCAL
    status, _ = await s.post("/v1/completions", {"prompt": list(range(1, 300))})
    assert status == 200  # past the local threshold, but no P: degraded to local, not down
    assert s.decode.events[1].mode is TransferMode.LOCAL
    body = {"prompt": list(range(1, 300)), "kvpush_mode": "push"}
    status, error = await s.post("/v1/completions", body)
    assert status == 503 and error["error"]["code"] == "no_workers"


async def test_ready_follows_heartbeats_leases_and_draining(stack: StackFactory, bus: Bus) -> None:
    """/v1/models agrees with /ready; a request sent before any worker registered waits for
    one of each role and is answered once they are up (workers start after the gateway)."""
    s = await stack(prefill=(), decode=())
    status, ready = await s.call("GET", "/ready")
    assert status == 503 and len(ready["missing"]) == 2
    status, models = await s.call("GET", "/v1/models")
    assert status == 503 and models["error"]["message"] == "not ready: " + "; ".join(
        ready["missing"]
    )
    assert (await s.call("GET", "/health"))[0] == 200
    early = asyncio.create_task(s.post("/v1/completions", {"prompt": "early", "max_tokens": 2}))
    await asyncio.sleep(0.3)
    assert not early.done()  # held, not refused
    d = await FakeWorker(bus, WorkerRole.DECODE, "rd").start()
    await asyncio.sleep(0.3)
    assert not early.done()  # ... until prefill has a worker too
    p = await FakeWorker(bus, WorkerRole.PREFILL, "rp").start()
    s.workers += [p, d]
    status, answer = await asyncio.wait_for(early, 10)
    assert status == 200 and answer["choices"][0]["text"], answer
    assert (await s.call("GET", "/v1/models"))[0] == 200

    async def ready_is(code: int) -> None:
        deadline = time.monotonic() + 3
        while (await s.call("GET", "/ready"))[0] != code:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    await ready_is(200)
    d.draining = True
    await ready_is(503)
    d.draining = False
    await ready_is(200)
    p.beating = False  # lease 0.5 s
    await ready_is(503)
    body = {"prompt": list(range(1, 300)), "kvpush_mode": "push"}
    status, error = await s.post("/v1/completions", body)
    assert status == 503, error


async def test_the_least_loaded_decode_worker_gets_the_request(stack: StackFactory) -> None:
    s = await stack(decode=("busy", "idle"))
    busy, idle = s.workers[1], s.workers[2]
    busy.in_flight = 5
    await asyncio.sleep(0.25)
    assert (await s.post("/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
    assert len(idle.events) == 1 and not busy.events


def shuffled_reply(event: Any) -> list[Any]:
    return [
        chunk(event, 1, "B"),
        chunk(event, 0, "A"),
        chunk(event, 0, "A"),  # duplicate
        chunk(event, 2, "C", finish_reason=FinishReason.STOP),
        chunk(event, 3, "late"),  # after the end: unknown
    ]


async def test_chunks_are_ordered_by_seq_and_strays_counted_and_dropped(
    stack: StackFactory,
) -> None:
    s = await stack(reply=shuffled_reply)
    status, answer = await s.post("/v1/completions", {"prompt": "x"})
    assert status == 200 and answer["choices"][0]["text"] == "ABC"
    assert answer["choices"][0]["finish_reason"] == "stop"
    await wait_until(lambda: s.gateway.streams.stats.unknown == 1)
    stats = s.gateway.streams.stats
    assert (stats.duplicates, stats.reordered) == (1, 1)
    _, metrics = await s.call("GET", "/metrics")
    assert 'kvpush_gateway_token_chunks_total{outcome="unknown"} 1.0' in metrics


async def test_two_gateways_each_get_only_their_own_tokens(stack: StackFactory) -> None:
    def echo_id(event: Any) -> list[Any]:
        return [chunk(event, 0, event.request_id, finish_reason=FinishReason.STOP)]

    one = await stack(reply=echo_id)
    two = await stack(share=one)
    assert one.gateway.config.gateway_id != two.gateway.config.gateway_id
    calls = [g.post("/v1/completions", {"prompt": str(i)}) for i in range(4) for g in (one, two)]
    for status, answer in await asyncio.gather(*calls):
        assert status == 200 and answer["choices"][0]["text"] == answer["id"]
    for g in (one, two):
        assert g.gateway.streams.stats.unknown == 0


async def test_models_metrics_and_trace_context(stack: StackFactory, spans: Any) -> None:
    s = await stack()
    status, listing = await s.call("GET", "/v1/models")
    assert status == 200 and listing["data"][0]["id"] == "kvpush-tiny"
    assert listing["data"][0]["max_model_len"] == 4096
    await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    await s.post("/v1/completions", {"model": "nope", "prompt": "x"})
    _, text = await s.call("GET", "/metrics")
    for line in (
        'kvpush_gateway_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        'kvpush_gateway_requests_total{endpoint="/v1/completions",status="404"} 1.0',
        'kvpush_gateway_time_to_first_token_seconds_count{mode="local"} 1.0',
        'kvpush_gateway_workers{role="decode"} 1.0',
        "kvpush_gateway_requests_in_flight 0.0",
        "kvpush_gateway_completion_tokens_total 2.0",
    ):
        assert line in text, line
    finished = spans.get_finished_spans()
    [root] = [x for x in finished if "kvpush.request_id" in (x.attributes or {})]
    assert root.attributes["kvpush.request_id"].startswith("cmpl-")
    received = [
        x
        for x in finished
        if x.name == "bus.receive"
        and x.attributes["messaging.destination.name"].startswith("kvpush.v1.req.")
    ]
    assert received and all(x.context.trace_id == root.context.trace_id for x in received)
    assert {"gateway.route", "gateway.first_byte", "bus.publish"} <= {x.name for x in finished}


async def test_a_client_s_x_request_id_names_the_answer_and_comes_back(
    stack: StackFactory,
) -> None:
    s = await stack(local_threshold=0)
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


async def test_two_answers_at_once_under_one_x_request_id_both_come(stack: StackFactory) -> None:
    s = await stack(local_threshold=0)
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


async def test_a_long_prompt_is_tokenized_in_pieces_to_the_ids_of_one_call(
    stack: StackFactory, tokenizer: Any, monkeypatch: Any
) -> None:
    """Long text prompts take ``long_prompts`` (cut before words, encoded at once); the ids
    are the tokenizer's own. The length from which it applies is lowered so that a prompt
    within the tiny model's context takes it."""
    from kvpush.services.gateway import long_prompts

    texts: list[str] = []
    encode = long_prompts.PieceTokenizer.encode

    def recorded(self: Any, text: str, special: bool, piece_chars: int = 64) -> list[int]:
        texts.append(text)
        return encode(self, text, special, piece_chars=64)

    monkeypatch.setattr(long_prompts, "MIN_CHARS", 400)
    monkeypatch.setattr(long_prompts.PieceTokenizer, "encode", recorded)
    s = await stack(max_body_bytes=1 << 20)
    texts.clear()  # the check at start encodes its own texts
    prompt = " ".join(f"Word{i % 7} and, then x{i}. (it's {i * 37})" for i in range(60))
    status, answer = await s.post("/tokenize", {"model": "kvpush-tiny", "prompt": prompt})
    assert status == 200, answer
    assert answer["tokens"] == tokenizer(prompt)["input_ids"] and texts == [prompt]
    status, answer = await s.post("/tokenize", {"model": "kvpush-tiny", "prompt": "short one"})
    assert answer["tokens"] == tokenizer("short one")["input_ids"] and texts == [prompt]
