"""The parity suite compares a stream by what its client sees, not by its chunks
(``tests.e2e.parity_cases.stream_view``): ``vllm serve`` under load merged two tokens into one
chunk, and a chunk-by-chunk comparison failed a clean-clone run."""

from __future__ import annotations

from typing import Any

from tests.e2e.parity_cases import stream_view


def _chat(parts: list[str], finish: str = "stop", done: bool = True) -> list[Any]:
    head = {"object": "chat.completion.chunk", "model": "m"}
    events: list[Any] = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for part in parts:
        choice = {"index": 0, "delta": {"content": part}, "logprobs": {"content": [{"t": part}]}}
        events.append({**head, "choices": [choice]})
    last = {"index": 0, "delta": {}, "finish_reason": finish}
    events.append({**head, "choices": [last]})
    events.append({**head, "choices": [], "usage": {"completion_tokens": 3}})
    return [*events, "[DONE]"] if done else events


def test_the_same_answer_chunked_differently_reads_the_same() -> None:
    split = stream_view(_chat(["Hel", "lo", " world"]))
    merged = stream_view(_chat(["Hello", " world"]))
    assert split["choices"][0]["text"] == "Hello world"
    assert split["usage"] == {"completion_tokens": 3} and split["done"]
    # log-probabilities are per token: a merged chunk carries both tokens' entries
    merged["choices"][0]["logprobs"] = split["choices"][0]["logprobs"]
    assert split == merged


def test_completions_chunks_join_text_token_ids_and_logprobs() -> None:
    def chunk(text: str, ids: list[int], finish: str | None = None) -> dict[str, Any]:
        logprobs = {"tokens": [text], "token_logprobs": [-0.5]}
        choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": logprobs}
        return {
            "object": "text_completion",
            "model": "m",
            "choices": [{**choice, "finish_reason": finish}],
        }

    view = stream_view([chunk("a", [1]), chunk("b", [2], "length"), "[DONE]"])
    (choice,) = view["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (
        "ab",
        [1, 2],
        "length",
    )
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.5]}


def test_what_a_client_would_notice_differs() -> None:
    base = stream_view(_chat(["Hello", " world"]))
    assert stream_view(_chat(["Hello", " there"])) != base
    assert stream_view(_chat(["Hello", " world"], finish="length")) != base
    assert stream_view(_chat(["Hello", " world"], done=False)) != base
