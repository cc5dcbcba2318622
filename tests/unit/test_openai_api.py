"""OpenAI request parsing and response shapes: valid bodies map to SamplingSpec, bad ones to 4xx."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.schemas.messages import TransferMode
from kvpush.schemas.sampling import MAX_OUTPUT_TOKENS, SamplingSpec
from kvpush.services.gateway import openai_api as api
from kvpush.services.gateway.openai_api import ApiError, Endpoint, parse_request

COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def rejected(endpoint: Endpoint, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(endpoint, body(**fields))
    assert info.value.status == 400
    return info.value


class FakeTokenizer:
    """Characters as token ids, BOS = 0, like a tokenizer that adds BOS by default."""

    def __init__(self, batch_encoding: bool = False) -> None:
        self.batch_encoding = batch_encoding

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [0, *(ord(c) % 100 + 1 for c in text)]}

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        assert kwargs == {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("roles must be system, user or assistant")
        ids = [0] + [len(m["content"]) + 1 for m in messages] + [99]
        return {"input_ids": ids} if self.batch_encoding else ids


def test_completion_defaults_follow_openai() -> None:
    parsed = parse_request(COMPLETIONS, body(model="m", prompt="hi"))
    assert parsed.max_tokens == 16 and not parsed.stream and not parsed.include_usage
    spec = api.sampling_spec(parsed, prompt_len=3, max_model_len=100)
    assert spec == SamplingSpec(max_tokens=16)


def test_vllm_bench_serve_payloads_are_accepted() -> None:
    completions = parse_request(
        COMPLETIONS,
        body(
            model="m",
            prompt="x",
            repetition_penalty=1.0,
            max_tokens=8,
            logprobs=None,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
            top_k=0,
            min_p=0.0,
            temperature=0,
        ),
    )
    assert completions.stream and completions.include_usage
    spec = api.sampling_spec(completions, 5, 100)
    assert spec.ignore_eos and spec.top_k == -1 and spec.temperature == 0.0
    chat = parse_request(
        CHAT,
        body(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    assert chat.max_tokens == 7 and chat.messages == [{"role": "user", "content": "hi"}]


def test_sampling_fields_and_vllm_extensions_reach_the_spec() -> None:
    parsed = parse_request(
        COMPLETIONS,
        body(
            prompt=[1, 2, 3],
            max_tokens=9,
            min_tokens=4,
            temperature=0.5,
            top_p=0.9,
            seed=-3,
            stop="END",
            stop_token_ids=[7],
            kvpush_mode="pull",
            top_k=40,
        ),
    )
    assert parsed.prompt == [1, 2, 3] and parsed.mode is TransferMode.PULL
    spec = api.sampling_spec(parsed, 3, 100)
    assert spec == SamplingSpec(
        max_tokens=9,
        min_tokens=4,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=-3,
        stop=["END"],
        stop_token_ids=[7],
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": True},
        {"max_tokens": 0},
        {"max_tokens": 2.0},
        {"max_tokens": MAX_OUTPUT_TOKENS + 1},
        {"temperature": 2.5},
        {"temperature": "hot"},
        {"top_p": 0},
        {"seed": 2**63},
        {"n": 2},
        {"n": True},
        {"best_of": 3},
        {"logprobs": 1},
        {"echo": True},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"stop": [1]},
        {"stop": ["a"] * 17},
        {"stop_token_ids": [-1]},
        {"kvpush_mode": "teleport"},
        {"stream": "yes"},
        {"stream_options": []},
        {"response_format": {"type": "json_object"}},
        {"model": 5},
        {"prompt": ["a", "b"]},
        {"prompt": []},
        {"prompt": [1, "2"]},
        {"prompt": {"text": "x"}},
    ],
)
def test_bad_completion_fields_are_400_with_the_param(fields: dict[str, Any]) -> None:
    error = rejected(COMPLETIONS, **{"prompt": "x", **fields})
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert error.param in (*fields, None)


def test_bad_json_and_non_objects_are_400() -> None:
    for raw in (b"", b"{", b"[1, 2]", b"null", b"\xff\xfe", b"{" * 100_000):
        with pytest.raises(ApiError) as info:
            parse_request(COMPLETIONS, raw)
        assert info.value.status == 400


def test_chat_messages_are_validated_and_text_parts_joined() -> None:
    rejected(CHAT, messages=[])
    rejected(CHAT, messages=[{"content": "no role"}])
    rejected(CHAT, messages=[{"role": "user", "content": 3}])
    rejected(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    rejected(CHAT, messages=[{"role": "user", "content": "x"}], logprobs=True)
    parsed = parse_request(
        CHAT,
        body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            logprobs=False,
        ),
    )
    assert parsed.messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    assert parsed.max_tokens is None  # chat: the rest of the context


def test_context_length_and_min_tokens_are_checked_after_tokenizing() -> None:
    parsed = parse_request(COMPLETIONS, body(prompt="x", max_tokens=10, min_tokens=11))
    with pytest.raises(ApiError, match="min_tokens"):
        api.sampling_spec(parsed, 5, 100)
    parsed = parse_request(COMPLETIONS, body(prompt="x", max_tokens=10))
    assert api.sampling_spec(parsed, 90, 100).max_tokens == 10
    with pytest.raises(ApiError, match="maximum context length is 100") as info:
        api.sampling_spec(parsed, 91, 100)
    assert info.value.status == 400 and info.value.param == "prompt"
    chat = parse_request(CHAT, body(messages=[{"role": "user", "content": "x"}]))
    assert api.sampling_spec(chat, 60, 100).max_tokens == 40
    with pytest.raises(ApiError):
        api.sampling_spec(chat, 100, 100)


def test_tokenization_adds_bos_for_text_keeps_token_ids_and_uses_the_chat_template() -> None:
    tok = FakeTokenizer()
    text = parse_request(COMPLETIONS, body(prompt="ab"))
    assert api.prompt_token_ids(text, tok, 100) == [0, 98, 99]
    ids = parse_request(COMPLETIONS, body(prompt=[5, 6]))
    assert api.prompt_token_ids(ids, tok, 100) == [5, 6]
    too_big = parse_request(COMPLETIONS, body(prompt=[5, 100]))
    with pytest.raises(ApiError, match="vocabulary"):
        api.prompt_token_ids(too_big, tok, 100)
    chat = parse_request(CHAT, body(messages=[{"role": "user", "content": "hey"}]))
    assert api.prompt_token_ids(chat, tok, 100) == [0, 4, 99]
    assert api.prompt_token_ids(chat, FakeTokenizer(batch_encoding=True), 100) == [0, 4, 99]
    odd_role = parse_request(CHAT, body(messages=[{"role": "wizard", "content": "x"}]))
    with pytest.raises(ApiError, match="chat template") as info:
        api.prompt_token_ids(odd_role, tok, 100)
    assert info.value.status == 400


def test_response_and_chunk_shapes() -> None:
    usage = api.usage_body(3, 2)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = api.Shaper(CHAT, "chatcmpl-1", 7, "m", include_usage=True)
    full = chat.response("hi", "stop", usage)
    assert full["object"] == "chat.completion" and full["usage"] == usage
    assert full["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    first = chat.chunk("a", None, first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert chat.chunk("b", "length", first=False)["choices"][0]["delta"] == {"content": "b"}
    assert chat.usage_chunk(usage)["choices"] == []
    text = api.Shaper(COMPLETIONS, "cmpl-1", 7, "m")
    assert text.response("x", "length", usage)["object"] == "text_completion"
    chunk = text.chunk("x", None, first=True)
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"][0]["text"] == "x"


# ---- property: no body, however odd, gets anything but a 4xx -------------------------------
_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "kvpush_mode",
    "best_of",
    "min_p",
    "repetition_penalty",
    "response_format",
    "logit_bias",
]
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", 3])},
        optional={"content": _json_values},
    ),
    max_size=3,
)
_bodies = st.dictionaries(
    st.sampled_from(_FIELDS),
    _json_values
    | st.integers(min_value=-2, max_value=5000)
    | st.lists(st.integers(min_value=-1, max_value=3000), max_size=5)
    | _messages,
    max_size=8,
)


def _never_5xx(endpoint: Endpoint, raw: bytes) -> None:
    try:
        parsed = parse_request(endpoint, raw)
        ids = api.prompt_token_ids(parsed, FakeTokenizer(), 2048)
        spec = api.sampling_spec(parsed, len(ids), 4096)
    except ApiError as exc:
        assert 400 <= exc.status < 500
        assert exc.body()["error"]["message"]
        return
    assert isinstance(spec, SamplingSpec) and 1 <= spec.max_tokens + len(ids) <= 4096


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(endpoint=st.sampled_from([COMPLETIONS, CHAT]), fields=_bodies)
def test_any_json_body_is_accepted_or_a_4xx(endpoint: Endpoint, fields: dict[str, Any]) -> None:
    _never_5xx(endpoint, json.dumps(fields).encode())


@settings(max_examples=200, deadline=None)
@given(endpoint=st.sampled_from([COMPLETIONS, CHAT]), raw=st.binary(max_size=64))
def test_any_bytes_are_accepted_or_a_4xx(endpoint: Endpoint, raw: bytes) -> None:
    _never_5xx(endpoint, raw)
