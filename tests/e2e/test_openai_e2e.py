"""The whole stack end to end over HTTP with the official ``openai`` client.

``kvpush up`` (its own nats-server, the tiny model, P on core 0, D on core 1, the gateway)
serves every test. Greedy answers moved by push and pull are compared with the aggregated
answer: the same stack in mode local, where the decode engine computes the prompt itself
(short prompts hold no full KV block, so neither run can reuse the other's prefix cache), and
the gateway's kv outcome counter must show every push/pull answer came from moved KV (a silent
recompute on D fails the test).
Error cases each check status and OpenAI error body, then that the stack still serves. The
last two tests stop the stack: SIGTERM drains the decode worker, Ctrl-C stops ``kvpush up``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest

from kvpush.services.natsd import EmbeddedNats
from tests.e2e.conftest import DECODE_ID, PREFILL_ID, GatewayFactory, UpStack, alive, child_pids
from tests.integration.worker_proc import Observer

pytestmark = pytest.mark.engine

MODEL = "kvpush-tiny"
PROMPTS = ["Hello there", "1 2 3", "Flitul quean pyst, the plel of stroun:", "Why?"]
MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "What is the plel of stroun?"},
    ],
]


def greedy(mode: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "extra_body": {"kvpush_mode": mode, **extra},
    }


async def complete(client: openai.AsyncOpenAI, prompt: Any, mode: str, **kw: Any) -> Any:
    return await client.completions.create(prompt=prompt, **greedy(mode, **kw))


async def streamed(stream: Any) -> tuple[str, list[str | None], Any, str]:
    """The text of a stream, every chunk's finish_reason, the usage it ended with, its id."""
    texts, finishes, usage, response_id = [], [], None, ""
    async for chunk in stream:
        usage = chunk.usage or usage
        response_id = response_id or chunk.id
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = getattr(choice, "delta", None)
        texts.append((delta.content if delta is not None else choice.text) or "")
        finishes.append(choice.finish_reason)
    return "".join(texts), finishes, usage, response_id


async def assert_serving(stack: UpStack) -> None:
    """The stack still answers a request correctly."""
    out = await complete(stack.client(), "still there?", "push", max_tokens=4)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


async def assert_kv_received(stack: UpStack, moved: list[tuple[str, str]]) -> None:
    """Each (response id, mode) was served with KV that D got from P: the gateway recorded it
    as "received" in that mode, not as a fallback to D computing the prompt itself."""
    expected = Counter((mode, "received") for _, mode in moved)
    outcomes = await stack.kv_outcomes([rid for rid, _ in moved])
    assert outcomes == expected, stack.membership_lines()


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


# ---- answers --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_completions_equal_the_aggregated_answer_streamed_or_not(
    up_stack: UpStack, mode: str
) -> None:
    client = up_stack.client()
    moved = []
    for prompt in PROMPTS:
        ref = await complete(client, prompt, "local")
        got = await complete(client, prompt, mode)
        moved.append((got.id, mode))
        assert got.choices[0].text == ref.choices[0].text != ""
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            ref.usage.prompt_tokens,
            16,
        )
        stream = await client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy(mode)
        )
        text, finishes, usage, response_id = await streamed(stream)
        moved.append((response_id, mode))
        assert text == ref.choices[0].text
        assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
        assert usage is not None and usage.completion_tokens == 16
    await assert_kv_received(up_stack, moved)


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_chat_equals_the_aggregated_answer_streamed_or_not(
    up_stack: UpStack, mode: str
) -> None:
    client = up_stack.client()
    moved = []
    for messages in MESSAGES:
        ref = await client.chat.completions.create(messages=messages, **greedy("local"))
        got = await client.chat.completions.create(messages=messages, **greedy(mode))
        moved.append((got.id, mode))
        answer = ref.choices[0].message.content
        assert got.choices[0].message.content == answer != ""
        assert got.choices[0].message.role == "assistant"
        assert got.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            messages=messages, stream=True, **greedy(mode)
        )
        text, finishes, _, response_id = await streamed(stream)
        moved.append((response_id, mode))
        assert text == answer and finishes[-1] == "length"
    await assert_kv_received(up_stack, moved)


async def test_a_long_prompt_moved_by_push_and_pull_gives_the_aggregated_answer(
    up_stack: UpStack, rng: random.Random
) -> None:
    """Three blocks of prompt: the local answer first (nothing cached yet), then push and pull
    (D's prefix cache now holds the first blocks: P moves the rest)."""
    client = up_stack.client()
    ids = [rng.randrange(10, 2000) for _ in range(300)]
    ref = await complete(client, ids, "local", max_tokens=24)
    for mode in ("push", "pull"):
        got = await complete(client, ids, mode, max_tokens=24)
        assert got.choices[0].text == ref.choices[0].text != ""
        assert got.usage.prompt_tokens == 300
        await assert_kv_received(up_stack, [(got.id, mode)])


async def test_twenty_concurrent_requests_are_all_correct(
    up_stack: UpStack, rng: random.Random
) -> None:
    client = up_stack.client()
    prompts = [" ".join(str(rng.randrange(10**6)) for _ in range(8)) for _ in range(20)]
    refs = [(await complete(client, p, "local")).choices[0].text for p in prompts]

    moved: list[tuple[str, str]] = []

    async def one(i: int, prompt: str) -> str:
        mode = "push" if i % 3 else "pull"
        if i % 2:
            got = await complete(client, prompt, mode)
            moved.append((got.id, mode))
            return got.choices[0].text
        stream = await client.completions.create(prompt=prompt, stream=True, **greedy(mode))
        text, _, _, response_id = await streamed(stream)
        moved.append((response_id, mode))
        return text

    answers = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    assert answers == refs
    await assert_kv_received(up_stack, moved)


# ---- errors ---------------------------------------------------------------------------------
async def test_bad_requests_get_their_status_and_an_openai_error_body(up_stack: UpStack) -> None:
    url = f"{up_stack.url}/v1/completions"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, data=b"{not json", headers={"Content-Type": "x"}) as r:
            assert r.status == 400
            assert "JSON" in (await r.json())["error"]["message"]
        big = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
        async with http.post(url, data=big) as r:
            assert r.status == 413
            assert "too large" in (await r.json())["error"]["message"]
    await assert_serving(up_stack)
    client = up_stack.client()
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    # vLLM's serving layer answers these, in vLLM's words
    assert "does not exist" in error_of(missing.value)["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        await complete(client, "hi", "push", max_tokens=5000)
    assert "max_model_len=4096" in error_of(too_long.value)["message"]
    await assert_serving(up_stack)


async def test_over_the_inflight_limit_is_429(
    up_stack: UpStack, start_gateway: GatewayFactory
) -> None:
    gateway = await start_gateway(max_inflight=1, max_queued=0)
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    busy = await client.completions.create(
        prompt="busy", stream=True, **greedy("push", 3000, ignore_eos=True)
    )
    async for _ in busy:
        break  # the first token arrived: one request in flight
    with pytest.raises(openai.RateLimitError) as limited:
        await complete(client, "one more", "push")
    assert error_of(limited.value)["code"] == "rate_limit_exceeded"
    await busy.close()
    await assert_serving(up_stack)


async def test_a_gateway_without_workers_holds_requests_then_answers_503(
    up_stack: UpStack, start_gateway: GatewayFactory
) -> None:
    with EmbeddedNats() as empty:
        # a request waits for workers this long from the gateway's start, then 503 says why
        gateway = await start_gateway(nats_url=empty.url, ready=False, start_timeout_s=1.0)
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as unavailable:
            await complete(client, "anyone?", "push")
        assert unavailable.value.status_code == 503
        error = error_of(unavailable.value)
        assert error["code"] == "workers_not_ready", error
        assert "no prefill worker has registered in the 1 s" in error["message"]
        with pytest.raises(openai.APIStatusError) as listing:
            await client.models.list()
        assert listing.value.status_code == 503
        async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/ready") as r:
            assert r.status == 503 and not (await r.json())["ready"]
        await gateway.stop()
    await assert_serving(up_stack)


async def test_a_request_past_its_deadline_is_504_and_its_workers_are_freed(
    up_stack: UpStack, start_gateway: GatewayFactory, observer: Observer
) -> None:
    """Deadlines: the first token's (``request_timeout_s``), then the gap between tokens
    (``stream_idle_timeout_s``); no total one. Both expire at once here (a microsecond)."""
    for limits in ({"request_timeout_s": 1e-6}, {"stream_idle_timeout_s": 1e-6}):
        gateway = await start_gateway(**limits)
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as timed_out:
            await complete(client, "slow", "push", max_tokens=3500, ignore_eos=True)
        assert timed_out.value.status_code == 504, limits
        assert error_of(timed_out.value)["code"] == "timeout"
        why = "no first token" if "request_timeout_s" in limits else "no token for"
        assert why in error_of(timed_out.value)["message"]
        await observer.fresh_beat(DECODE_ID, lambda b: b.in_flight == 0, timeout_s=5)
    await assert_serving(up_stack)


async def test_client_disconnect_mid_stream_frees_blocks_on_both_engines(
    up_stack: UpStack, observer: Observer, rng: random.Random
) -> None:
    client = up_stack.client()
    ids = [rng.randrange(10, 2000) for _ in range(700)]
    stream = await client.completions.create(
        prompt=ids, stream=True, **greedy("push", 3000, ignore_eos=True)
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 5:
            break
    busy = await observer.fresh_beat(DECODE_ID, lambda b: b.in_flight == 1)
    assert busy.free_blocks < busy.total_blocks  # D holds the request's blocks
    await stream.close()  # the client goes away mid-stream
    for worker in (PREFILL_ID, DECODE_ID):
        await observer.fresh_beat(
            worker, lambda b: b.in_flight == 0 and b.free_blocks == b.total_blocks, 10
        )
    await assert_serving(up_stack)


async def test_two_gateways_serve_at_once(up_stack: UpStack, start_gateway: GatewayFactory) -> None:
    second = await start_gateway()
    clients = [up_stack.client(), openai.AsyncOpenAI(base_url=f"{second.url}/v1", api_key="x")]
    prompts = [f"gateway test {i}" for i in range(6)]
    refs = [(await complete(clients[0], p, "local")).choices[0].text for p in prompts]
    answers = await asyncio.gather(
        *(complete(clients[i % 2], p, "push") for i, p in enumerate(prompts))
    )
    assert [a.choices[0].text for a in answers] == refs


# ---- lifecycle (these stop the stack: they run last, tests/e2e/conftest.py) -------------------
@pytest.mark.stops_up_stack
async def test_sigterm_on_the_decode_worker_drains_it(
    up_stack: UpStack, observer: Observer
) -> None:
    client = up_stack.client()
    pid = up_stack.worker_pid(DECODE_ID)
    stream = await client.completions.create(
        prompt="keep going", stream=True, **greedy("push", 200, ignore_eos=True)
    )
    chunks = 0
    async for chunk in stream:
        chunks += 1
        if chunks == 1:
            os.kill(pid, signal.SIGTERM)
        finish = chunk.choices[0].finish_reason if chunk.choices else None
    assert finish == "length"  # the request in flight finished: every token came
    assert any(b.draining for b in observer.beats[DECODE_ID])
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, "the drained worker did not exit"
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.6)  # up polls its children twice a second
    assert f"{DECODE_ID} exited with status 0" in up_stack.output()
    with pytest.raises(openai.APIStatusError) as unavailable:
        await complete(client, "anyone?", "push")
    assert unavailable.value.status_code == 503


@pytest.mark.stops_up_stack
def test_kvpush_up_stops_everything_on_ctrl_c(up_stack: UpStack) -> None:
    children = child_pids(up_stack.proc.pid)
    assert len(children) >= 3  # nats-server, prefill worker, gateway (decode may be gone)
    up_stack.proc.send_signal(signal.SIGINT)
    assert up_stack.proc.wait(60) == 0, up_stack.logs()
    assert [pid for pid in children if alive(pid)] == []
    output = up_stack.output()
    assert f"{PREFILL_ID} stopped (status 0)" in output and "gateway stopped (status 0)" in output
    progress = (up_stack.log_dir / "up.err").read_text()
    assert progress.rstrip().endswith("[kvpush up] stopped")
