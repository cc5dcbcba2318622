"""The parity suite compares a stream by what its client sees, not by its chunks
(``tests.e2e.parity_cases.stream_view``): ``vllm serve`` under load merged two tokens into one
chunk, and a chunk-by-chunk comparison failed a clean-clone run."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.parity_cases import normalized, sse_joined, stream_view

# one answer of three tokens: (text, id, log-probability)
TOKENS = [("Hel", 11, -0.51), ("lo", 12, -0.25), (" world", 13, -1.004)]
SPLIT = [[0], [1], [2]]  # a chunk per token
MERGED = [[0, 1], [2]]  # "Hel" and "lo" in one chunk, as a server under load sends them


def _sse(events: list[Any]) -> str:
    """Events as the body of a text/event-stream answer."""
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines)


def _view(events: list[Any]) -> Any:
    """As the parity suite reads a stream (``test_parity._call``)."""
    return normalized(stream_view(sse_joined(_sse(events))))


def _chat(
    chunks: list[list[int]],
    tokens: list[tuple[str, int, float]] = TOKENS,
    finish: str = "stop",
    done: bool = True,
    created: int = 1,
) -> list[Any]:
    head = {"id": f"chatcmpl-{created}", "object": "chat.completion.chunk", "created": created}
    head["model"] = "m"
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    events: list[Any] = [{**head, "choices": [first]}]
    for chunk in chunks:
        parts = [tokens[i] for i in chunk]
        content = [{"token": t, "logprob": lp, "top_logprobs": []} for t, _, lp in parts]
        delta = {"content": "".join(t for t, _, _ in parts)}
        choice = {"index": 0, "delta": delta, "logprobs": {"content": content}}
        events.append({**head, "choices": [{**choice, "finish_reason": None}]})
    last = {"index": 0, "delta": {"content": ""}, "finish_reason": finish, "stop_reason": None}
    events.append({**head, "choices": [last]})
    usage = {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 5 + len(tokens)}
    events.append({**head, "choices": [], "usage": usage})  # stream_options.include_usage
    return [*events, "[DONE]"] if done else events


def _completions(chunks: list[list[int]], continuous_usage: bool = False) -> list[Any]:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    events: list[Any] = []
    offset = 0
    for n, chunk in enumerate(chunks):
        parts = [TOKENS[i] for i in chunk]
        offsets = []
        for text, _, _ in parts:
            offsets.append(offset)
            offset += len(text)
        logprobs = {
            "tokens": [t for t, _, _ in parts],
            "token_logprobs": [lp for _, _, lp in parts],
            "top_logprobs": [{t: lp} for t, _, lp in parts],
            "text_offset": offsets,
        }
        last = n == len(chunks) - 1
        choice = {
            "index": 0,
            "text": "".join(t for t, _, _ in parts),
            "token_ids": [i for _, i, _ in parts],
            "logprobs": logprobs,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        if n == 0:
            choice["prompt_token_ids"] = [1, 2, 3]
        event: dict[str, Any] = {**head, "choices": [choice]}
        if continuous_usage:  # usage on every chunk, counted so far
            done = sum(len(c) for c in chunks[: n + 1])
            event["usage"] = {"prompt_tokens": 3, "completion_tokens": done}
        events.append(event)
    if not continuous_usage:
        events.append(
            {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
        )
    return [*events, "[DONE]"]


def test_the_same_chat_answer_chunked_differently_reads_the_same() -> None:
    split, merged = _view(_chat(SPLIT)), _view(_chat(MERGED, created=2))
    assert split == merged
    (choice,) = split["choices"]
    assert choice["roles"] == ["assistant"]
    assert choice["text"] == "Hello world"
    assert choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hel", "lo", " world"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.51, -0.25, -1.0]
    assert split["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert split["done"] and split["errors"] == []
    assert split["fields"] == {"object": ["chat.completion.chunk"], "model": ["m"]}


def test_the_same_completions_answer_chunked_differently_reads_the_same() -> None:
    for continuous_usage in (False, True):
        split = _view(_completions(SPLIT, continuous_usage))
        merged = _view(_completions(MERGED, continuous_usage))
        assert split == merged
        (choice,) = split["choices"]
        assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (
            "Hello world",
            [11, 12, 13],
            [1, 2, 3],
        )
        assert choice["logprobs"] == {
            "tokens": ["Hel", "lo", " world"],
            "token_logprobs": [-0.51, -0.25, -1.0],
            "top_logprobs": [{"Hel": -0.51}, {"lo": -0.25}, {" world": -1.0}],
            "text_offset": [0, 3, 5],
        }
        assert choice["finish_reason"] == "length"
        assert split["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}


def test_tool_calls_merge_by_index_whatever_the_chunking() -> None:
    def stream(parts: list[list[dict[str, Any]]]) -> Any:
        head = {"object": "chat.completion.chunk", "model": "m"}
        events: list[Any] = [
            {**head, "choices": [{"index": 0, "delta": {"tool_calls": p}}]} for p in parts
        ]
        events.append(
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
        )
        return _view([*events, "[DONE]"])

    name = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather"}}

    def args(text: str, index: int = 0) -> dict[str, Any]:
        return {"index": index, "function": {"arguments": text}}

    split = stream([[name], [args('{"city": ')], [args('"Paris"}')]])
    merged = stream([[name, args('{"city": "Paris"}')]])
    assert split == merged
    assert split["choices"][0]["tool_calls"] == [
        {
            "index": 0,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]  # the id is dropped by normalized, as every id
    assert stream([[name], [args('{"city": "Rome"}')]]) != split
    second = {**name, "index": 1}
    two = stream([[name, second], [args("{}"), args("{}", 1)]])
    assert [c["index"] for c in two["choices"][0]["tool_calls"]] == [0, 1]


def test_reasoning_joins_apart_from_content() -> None:
    head = {"object": "chat.completion.chunk", "model": "m"}

    def stream(deltas: list[dict[str, Any]]) -> Any:
        return _view([{**head, "choices": [{"index": 0, "delta": d}]} for d in deltas])

    split = stream([{"reasoning": "thi"}, {"reasoning": "nk"}, {"content": "ok"}])
    merged = stream([{"reasoning": "think"}, {"content": "ok"}])
    assert split == merged
    assert (split["choices"][0]["reasoning"], split["choices"][0]["text"]) == ("think", "ok")
    assert stream([{"content": "think"}, {"content": "ok"}]) != split


def test_choices_join_by_index() -> None:
    head = {"object": "text_completion", "model": "m"}

    def stream(parts: list[tuple[int, str]]) -> Any:
        events = [{**head, "choices": [{"index": i, "text": t}]} for i, t in parts]
        return _view([*events, "[DONE]"])

    interleaved = stream([(0, "a"), (1, "x"), (0, "b"), (1, "y")])
    assert interleaved == stream([(1, "xy"), (0, "ab")])
    assert [c["text"] for c in interleaved["choices"]] == ["ab", "xy"]


def test_what_a_client_would_notice_differs() -> None:
    base = _view(_chat(MERGED))
    other = [("Hel", 11, -0.51), ("lo", 12, -0.25), (" there", 14, -1.0)]
    assert _view(_chat(MERGED, tokens=other)) != base  # content
    assert _view(_chat(MERGED, finish="length")) != base  # finish reason
    assert _view(_chat(MERGED, done=False)) != base  # no [DONE]
    slower = [("Hel", 11, -0.51), ("lo", 12, -0.25), (" world", 13, -2.0)]
    assert _view(_chat(MERGED, tokens=slower)) != base  # log-probabilities
    no_usage = [e for e in _chat(MERGED) if not (isinstance(e, dict) and "usage" in e)]
    assert _view(no_usage) != base


def test_error_events_are_kept_as_they_are() -> None:
    error = {"error": {"object": "error", "type": "BadRequestError", "code": 400}}
    events = [*_chat(MERGED)[:-2], error, "[DONE]"]
    view = _view(events)
    assert view["errors"] == [error]
    assert view != _view(_chat(MERGED))
