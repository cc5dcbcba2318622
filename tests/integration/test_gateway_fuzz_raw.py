"""Fuzzing the gateway's request handling (vLLM's serving layer) with raw HTTP, against fake
workers on the session's real nats-server.

- hypothesis: arbitrary bytes, arbitrary JSON, known fields with values of every type, invalid
  UTF-8, any method on any path.
- Edge-case tables: NaN/Infinity/huge-number literals, deep nesting and lone surrogates in
  every field; absurd sampling values, prompts past the context (each a 400, as vLLM's serving
  layer answers).

Every answer is a 4xx with an OpenAI error body (or a 200 where the input is valid), never a
5xx or a stack trace, and comes within ``TIMEOUT_S``; afterwards the gateway still serves a
valid request and has nothing in flight. The OpenAPI document and schemathesis are in
``test_gateway_fuzz``; shared helpers in ``gateway_fuzz_helpers``. All generation is
deterministic (``derandomize=True``, no example database).

Threading model: each test's gateway and fake workers run on the test's event loop; the
synchronous client (``requests``) runs on one worker thread (``asyncio.to_thread``), so the
loop keeps serving while it waits.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import requests
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.gateway_fakes import sse_events
from tests.integration.gateway_fuzz_helpers import (
    BASE,
    CHAT,
    COMPLETIONS,
    TIMEOUT_S,
    StackFactory,
    Statuses,
    assert_still_serving,
    fuzz,
    one_chunk_reply,
)

# Body fields of vLLM's request models (sampling, shapes, the prompt) and kvpush's extension.
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "min_tokens",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "kvpush_mode",
    "response_format",
    "logprobs",
    "n",
    "best_of",
    "echo",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "top_logprobs",
    "tools",
]

# Raw fuzzing: a short context (prompts past it are cheap), room for huge bodies, and a lease
# that outlives a loaded machine's late heartbeats (a 503 there would not be the gateway's).
RAW_GATEWAY: dict[str, Any] = {
    "reply": one_chunk_reply,
    "worker_lease_s": 30.0,
    "max_model_len": 256,
    "max_body_bytes": 1 << 20,
}


def check_answer(response: requests.Response, what: Any, generation: bool = True) -> Any:
    """A 200 (valid input: a completion when ``generation``) or a 4xx OpenAI error body; never
    a 5xx or a stack trace."""
    text = response.text
    context = f"{what!r:.300} -> {response.status_code} {text[:300]}"
    assert response.status_code < 500, context
    assert "Traceback" not in text and 'File "' not in text, context
    kind = response.headers.get("Content-Type", "")
    if response.status_code == 200:
        if kind.startswith("text/event-stream"):
            events = sse_events(text)
            assert events and all("error" not in e for e in events), context
            return events
        body = response.json()
        assert not generation or body["choices"][0]["finish_reason"] == "length", context
        return body
    assert 400 <= response.status_code < 500 and kind.startswith("application/json"), context
    body = response.json()
    assert set(body) == {"error"}, context
    assert set(body["error"]) == {"message", "type", "param", "code"}, context
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], context
    return body


def post(session: requests.Session, url: str, data: bytes) -> requests.Response:
    return session.post(
        url, data=data, headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S
    )


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, 1, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**12, 10**300, 10**4000])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e308, -1e308, 5e-324, -0.0, 2.0000001, 1e-9])
    | st.text(max_size=20)
    | st.sampled_from(["", "[DONE]", "push", "text", "\x00", "\ud800", "user"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def fuzz_raw_bodies(url: str, examples: int) -> Statuses:
    """Arbitrary bytes, arbitrary JSON, known fields with values of any type, invalid UTF-8,
    any method on any path; counts (case kind, status)."""
    statuses: Statuses = collections.Counter()
    with requests.Session() as session:

        def send(kind: str, path: str, data: bytes, method: str = "POST") -> Any:
            headers = {"Content-Type": "application/json"}
            response = session.request(
                method, url + path, data=data, headers=headers, timeout=TIMEOUT_S
            )
            statuses[kind, response.status_code] += 1
            generation = method == "POST" and path in (COMPLETIONS, CHAT)
            return check_answer(response, (method, path, data[:300]), generation)

        @fuzz(examples)
        @given(path=st.sampled_from([COMPLETIONS, CHAT]), data=st.binary(max_size=512))
        def raw_bytes(path: str, data: bytes) -> None:
            send("bytes", path, data)

        @fuzz(examples)
        @given(path=st.sampled_from([COMPLETIONS, CHAT]), value=json_values)
        def any_json(path: str, value: Any) -> None:
            send("json", path, dumps(value))

        @fuzz(examples * 3)
        @given(
            path=st.sampled_from([COMPLETIONS, CHAT]),
            fields=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values),
        )
        def wrong_types(path: str, fields: dict[str, Any]) -> None:
            send("fields", path, dumps({**BASE[path], **fields}))

        @fuzz(examples)
        @given(
            path=st.sampled_from([COMPLETIONS, CHAT]),
            junk=st.binary(min_size=1, max_size=32),
            where=st.sampled_from(["prompt", "content", "key", "model"]),
        )
        def invalid_utf8(path: str, junk: bytes, where: str) -> None:
            junk = junk.replace(b'"', b"").replace(b"\\", b"") + b"\xff"  # never valid UTF-8
            if where == "content" or (where == "prompt" and path == CHAT):
                data = b'{"messages": [{"role": "user", "content": "' + junk + b'"}]}'
            elif where == "prompt":
                data = b'{"prompt": "' + junk + b'", "max_tokens": 1}'
            elif where == "key":
                data = b'{"prompt": "x", "' + junk + b'": 1}'
            else:
                data = b'{"prompt": "x", "model": "' + junk + b'"}'
            answer = send("utf8", path, data)
            assert answer["error"]["message"] == "request body is not valid JSON"

        @fuzz(examples)
        @given(
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            path=st.sampled_from([COMPLETIONS, CHAT, "/v1/models", "/health", "/openapi.json"])
            | st.text(st.characters(codec="ascii", exclude_characters="?#%"), max_size=12).map(
                lambda p: "/v1/" + p
            ),
            data=st.binary(max_size=64),
        )
        def any_route(method: str, path: str, data: bytes) -> None:
            send("route", path, data, method)

        raw_bytes()
        any_json()
        wrong_types()
        invalid_utf8()
        any_route()
    return statuses


async def test_raw_fuzzed_bodies_get_4xx_openai_errors_or_200(stack: StackFactory) -> None:
    s = await stack(**RAW_GATEWAY)
    statuses = await asyncio.to_thread(fuzz_raw_bodies, s.gateway.url, 60)
    assert sum(statuses.values()) >= 400, statuses
    assert statuses["fields", 200] >= 10 and statuses["fields", 400] >= 10, statuses
    assert {status for _, status in statuses} >= {200, 400, 404, 405}, statuses
    await assert_still_serving(s)


# Literals JSON libraries disagree on, nesting past any recursion limit, lone surrogates.
LITERALS = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b"1e-999",
    b"-0",
    b"1" + b"0" * 4000,  # an integer Python can still print
    b"-1" + b"0" * 4400,  # ... and one past int_max_str_digits
    b"1" + b"0" * 400 + b".5",
    b"[" * 200 + b"]" * 200,
    b"[" * 900 + b"]" * 900,
    b"[" * 990 + b"]" * 990,
    b"[" * 5000 + b"]" * 5000,
    b'{"a":' * 950 + b"1" + b"}" * 950,
    b'"\\ud800"',
    b'"\\udfff x"',
    b'"\\ud800\\udc00"',
    b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8 (CESU): invalid UTF-8
    b'"\\u0000"',
]


def fuzz_literals(url: str) -> int:
    """Each literal in each field of both endpoints (a full table: these are the edge cases)."""
    sent = 0
    with requests.Session() as session:
        for path in (COMPLETIONS, CHAT):
            head = dumps(BASE[path])[:-1]
            for field in FIELDS:
                for literal in LITERALS:
                    data = head + b', "' + field.encode() + b'": ' + literal + b"}"
                    check_answer(post(session, url + path, data), data[:80])
                    sent += 1
    return sent


async def test_special_literals_and_deep_nesting_in_every_field(stack: StackFactory) -> None:
    s = await stack(**RAW_GATEWAY)
    sent = await asyncio.to_thread(fuzz_literals, s.gateway.url)
    assert sent == 2 * len(FIELDS) * len(LITERALS)
    await assert_still_serving(s)


# Values vLLM's request models and serving layer refuse (or kvpush's bounds on the bus): each a
# 400, naming the field where vLLM names one (None: vLLM's message names it, its param does not).
ABSURD: list[tuple[str, dict[str, Any], str | None]] = [
    (COMPLETIONS, {"temperature": 1e308}, "temperature"),
    (COMPLETIONS, {"temperature": -1}, "temperature"),
    (COMPLETIONS, {"temperature": 10**400}, "temperature"),
    (COMPLETIONS, {"top_p": 2}, "top_p"),
    (COMPLETIONS, {"top_p": 0}, "top_p"),
    (COMPLETIONS, {"top_p": 10**400}, "top_p"),
    (COMPLETIONS, {"max_tokens": 10**12}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 1.5}, "max_tokens"),
    (COMPLETIONS, {"min_tokens": 10**12}, None),
    (COMPLETIONS, {"min_tokens": 5, "max_tokens": 4}, None),
    (COMPLETIONS, {"n": 10**6}, None),
    (COMPLETIONS, {"suffix": "x" * 10**5}, "suffix"),
    (COMPLETIONS, {"stop": ["s"] * 10**4}, "stop"),
    (COMPLETIONS, {"stop": "x" * 257}, None),  # kvpush's bound on the bus
    (COMPLETIONS, {"stop": [1, 2]}, "stop"),
    (COMPLETIONS, {"stop_token_ids": list(range(10**4))}, "stop_token_ids"),
    (COMPLETIONS, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (COMPLETIONS, {"logit_bias": {str(i): 100 for i in range(10**4)}}, "logit_bias"),
    (COMPLETIONS, {"presence_penalty": 1e308}, None),
    (COMPLETIONS, {"frequency_penalty": -1e308}, None),
    (COMPLETIONS, {"repetition_penalty": 0}, None),
    (COMPLETIONS, {"top_k": 10**9}, None),  # kvpush's bound on the bus
    (COMPLETIONS, {"top_k": -2}, None),
    (COMPLETIONS, {"seed": 2**64}, "seed"),
    (COMPLETIONS, {"seed": -(2**63) - 1}, "seed"),
    (COMPLETIONS, {"stream_options": {"include_usage": 1}}, "stream_options"),
    (COMPLETIONS, {"stream_options": []}, "stream_options"),
    (COMPLETIONS, {"kvpush_mode": "teleport"}, "kvpush_mode"),
    (COMPLETIONS, {"kvpush_mode": ["push"]}, "kvpush_mode"),
    (COMPLETIONS, {"model": 7}, "model"),
    (COMPLETIONS, {"prompt": list(range(1, 300))}, "input_tokens"),  # past the context (256)
    (COMPLETIONS, {"prompt": "word " * 400}, "input_tokens"),
    (COMPLETIONS, {"prompt": [1] * 131_073}, "input_tokens"),
    (COMPLETIONS, {"prompt": [5, 10**12]}, None),
    (COMPLETIONS, {"prompt": [5, 4096]}, None),  # >= the vocabulary size
    (COMPLETIONS, {"prompt": []}, None),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    (CHAT, {"messages": []}, None),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 400}]}, "input_tokens"),
    (CHAT, {"messages": [{"role": 1, "content": "x"}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, None),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None),  # the template's roles
    (CHAT, {"max_completion_tokens": 10**12}, "max_completion_tokens"),
    (CHAT, {"max_completion_tokens": 2, "max_tokens": "lots"}, "max_tokens"),
    (CHAT, {"top_logprobs": 20}, "top_logprobs"),
]


def send_absurd(url: str) -> None:
    with requests.Session() as session:
        for path, fields, param in ABSURD:
            body = {**BASE[path], **fields}
            answer = check_answer(post(session, url + path, dumps(body)), fields)
            assert "error" in answer, (fields, answer)  # a 4xx (check_answer: never a 5xx)
            assert param is None or answer["error"]["param"] == param, (fields, answer)


async def test_absurd_values_are_400_naming_the_field(stack: StackFactory) -> None:
    s = await stack(**RAW_GATEWAY)
    await asyncio.to_thread(send_absurd, s.gateway.url)
    assert not s.decode.events  # nothing invalid was published
    await assert_still_serving(s)
