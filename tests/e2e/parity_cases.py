"""The parity suite's requests: what a client of ``vllm serve`` sends, by feature.

Each case is (name, feature, method, path, body) (``CASES``, and ``stop_cases`` made from the
greedy answers so that they do stop); the suite sends it to ``vllm serve`` and to a
kvpush stack (its gateway answers with vLLM's serving layer; push and pull) and compares the answers
(``normalized``); a stream compares by what its client sees, not by its chunks, whose
boundaries are timing-made (``stream_view`` of ``sse_joined``). ``docs/api.md``'s parity
table is generated from these cases and their outcomes (``tests/e2e/test_parity.py``).

Threading model: none (data and pure functions).
"""

from __future__ import annotations

from typing import Any

PROMPT = (
    "The history of the river valley begins with small farming villages along the banks, "
    "where families grew barley and wheat, kept goats, and traded pottery with travellers "
    "coming down from the northern hills. Over many generations the villages grew into towns "
    "with markets, temples and granaries, and the town councils kept written records of "
    "harvests, floods and disputes about water."
)
MODEL = "kvpush-tiny"
MESSAGES = [{"role": "user", "content": PROMPT}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}

Case = tuple[str, str, str, str, dict[str, Any] | None]


def _c(name: str, feature: str, **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, **fields}
    return (name, feature, "POST", "/v1/completions", body)


def _chat(name: str, feature: str, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0.0, **fields}
    return (name, feature, "POST", "/v1/chat/completions", body)


CASES: list[Case] = [
    _c("greedy", "completions, greedy"),
    _c("seeded", "seed, temperature, top_p", temperature=0.9, top_p=0.9, seed=42),
    _c("top_k", "top_k", temperature=1.0, top_k=5, seed=1),
    _c("min_p", "min_p", temperature=1.0, min_p=0.2, seed=3),
    _c("penalties", "presence/frequency penalties", presence_penalty=1.5, frequency_penalty=1.0),
    _c("repetition", "repetition_penalty", repetition_penalty=1.5),
    _c("logit_bias", "logit_bias", logit_bias={"100": 100}),
    _c("logprobs", "logprobs (completions)", logprobs=3),
    _c("echo", "echo", echo=True, max_tokens=4),
    _c("echo_logprobs", "echo with logprobs (prompt logprobs)", echo=True, logprobs=2),
    _c("n3_seeded", "n > 1", n=3, temperature=1.0, seed=5),
    _c("batch", "batch prompts", prompt=[PROMPT, PROMPT[:120]]),
    _c("token_ids", "return_token_ids", return_token_ids=True),
    _c("min_tokens", "min_tokens, ignore_eos", min_tokens=8, ignore_eos=True),
    _c("default_max", "max_tokens default (16)", max_tokens=None),
    _c("clamped", "max_tokens beyond the context", max_tokens=100_000),
    _c("truncate", "truncate_prompt_tokens", truncate_prompt_tokens=40),
    _c("bad_words", "bad_words", bad_words=["the"]),
    _c("special", "skip_special_tokens false", skip_special_tokens=False),
    _c("stream", "stream with usage", stream=True, stream_options={"include_usage": True}),
    _c("choice", "structured_outputs choice", structured_outputs={"choice": ["yes", "no"]}),
    _c("regex", "structured_outputs regex", structured_outputs={"regex": "[0-9]{3}"}),
    _chat("chat", "chat, greedy"),
    _chat(
        "developer",
        "developer and system roles",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in English."},
            *MESSAGES,
        ],
    ),
    _chat("chat_logprobs", "logprobs (chat)", logprobs=True, top_logprobs=2),
    _chat("chat_n2", "n > 1 (chat)", n=2, temperature=1.0, seed=9),
    _chat("chat_max_completion", "max_completion_tokens", max_tokens=None, max_completion_tokens=5),
    _chat(
        "json_schema",
        "response_format json_schema",
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    ),
    _chat("json_object", "response_format json_object", response_format={"type": "json_object"}),
    _chat(
        "named_tool",
        "tools, named tool_choice",
        max_tokens=30,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ),
    _chat(
        "continue",
        "continue_final_message",
        messages=[*MESSAGES, {"role": "assistant", "content": "The villages"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    _chat("template_kwargs", "chat_template_kwargs", chat_template_kwargs={"unused": True}),
    _chat("chat_stream", "stream (chat)", stream=True),
    _c("unknown_model", "unknown model: 404", model="no-such-model"),
    _c("too_many_logprobs", "logprobs above the limit: 400", logprobs=50),
    _c("bad_type", "a wrong type: 400", max_tokens="twelve"),
    ("tokenize", "/tokenize", "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}),
    (
        "tokenize_chat",
        "/tokenize (chat)",
        "POST",
        "/tokenize",
        {"model": MODEL, "messages": MESSAGES},
    ),
    ("detokenize", "/detokenize", "POST", "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}),
    ("models", "/v1/models", "GET", "/v1/models", None),
    ("version", "/version", "GET", "/version", None),
]

# cases whose answers must end "stop" (a case that never met its stop proves nothing)
STOPPING = ("stop", "stop_included", "stop_token_ids", "chat_stop")


def stop_cases(text: str, token_ids: list[int], chat_text: str) -> list[Case]:
    """Stop strings and tokens taken from the greedy answers (``text``, its ``token_ids``; the
    chat answer ``chat_text``), so that each case does stop where vLLM stops."""
    word, chat_word = text[3:5], chat_text[3:5]
    return [
        _c("stop", "stop strings", stop=[word, "never-there"]),
        _c(
            "stop_included",
            "include_stop_str_in_output",
            stop=[word],
            include_stop_str_in_output=True,
        ),
        _c("stop_token_ids", "stop_token_ids", stop_token_ids=[token_ids[4]]),
        _chat("chat_stop", "stop strings (chat)", stop=[chat_word]),
    ]


DROPPED = frozenset({"id", "created", "system_fingerprint"})


def normalized(value: Any) -> Any:
    """An answer without ids and timestamps, floats to 2 decimals (log-probabilities)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if k not in DROPPED}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, float):
        return round(value, 2)
    return value


def error_shape(status: int, body: Any) -> Any:
    """Errors compare by status and type (messages carry request-specific details)."""
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return {"status": status, "type": error.get("type")}


def sse_joined(text: str) -> list[Any]:
    """A stream's events (``data: ...`` lines) as JSON values, ``[DONE]`` kept as a string."""
    import json

    events: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_view(events: list[Any]) -> dict[str, Any]:
    """What a client of a stream sees, whatever its chunking (a server under load may merge
    tokens into one chunk: ``vllm serve`` did). Per choice index: the roles (chat), the joined
    text (completions: ``text``; chat: ``content``), the joined reasoning (``reasoning_content``,
    ``reasoning``), the tool calls merged by their index (id, type, name, joined arguments),
    the joined ``token_ids`` and ``prompt_token_ids``, the log-probabilities concatenated by
    key (completions: tokens, token_logprobs, top_logprobs, text_offset; chat: content), the
    last non-null finish and stop reason. For the stream: the values of ``object`` and
    ``model`` over its chunks, its usage (the last chunk that has one: the final
    ``include_usage`` chunk, or the last of ``continuous_usage_stats``), its error events as
    they are, and whether it ended with ``[DONE]``. A plain JSON-like value (``normalized``
    applies)."""
    choices: dict[int, dict[str, Any]] = {}
    fixed: dict[str, set[str]] = {}
    view: dict[str, Any] = {"done": bool(events) and events[-1] == "[DONE]", "errors": []}
    view["usage"] = None
    for event in events:
        if not isinstance(event, dict):
            continue
        if "error" in event:
            view["errors"].append(event)
            continue
        for key in ("object", "model"):
            fixed.setdefault(key, set()).add(str(event.get(key)))
        if event.get("usage") is not None:
            view["usage"] = event["usage"]
        for choice in event.get("choices") or []:
            _join_choice(choices.setdefault(choice.get("index", 0), _empty_choice()), choice)
    view["fields"] = {key: sorted(values) for key, values in fixed.items()}
    view["choices"] = [_choice_view(choices[index]) for index in sorted(choices)]
    return view


def _empty_choice() -> dict[str, Any]:
    return {
        "roles": [],
        "text": "",
        "reasoning_content": "",
        "reasoning": "",
        "tool_calls": {},
        "token_ids": [],
        "prompt_token_ids": [],
        "logprobs": {},
        "finish_reason": None,
        "stop_reason": None,
    }


def _join_choice(seen: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        if delta.get("role"):
            seen["roles"].append(delta["role"])
        seen["text"] += delta.get("content") or ""
        for key in ("reasoning_content", "reasoning"):
            seen[key] += delta.get(key) or ""
        for part in delta.get("tool_calls") or []:
            _join_tool_call(seen["tool_calls"], part)
    else:  # completions
        seen["text"] += choice.get("text") or ""
    seen["token_ids"] += choice.get("token_ids") or []
    seen["prompt_token_ids"] += choice.get("prompt_token_ids") or []
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):  # completions: lists by key; chat: {"content": [...]}
        for key, values in logprobs.items():
            if isinstance(values, list):
                seen["logprobs"].setdefault(key, []).extend(values)
    for key in ("finish_reason", "stop_reason"):
        if choice.get(key) is not None:
            seen[key] = choice[key]


def _join_tool_call(calls: dict[int, dict[str, Any]], part: dict[str, Any]) -> None:
    """A tool call's parts, merged by its index: the id, type and name a part carries (the
    last one given), the arguments joined."""
    call = calls.setdefault(
        part.get("index", 0), {"id": None, "type": None, "name": None, "arguments": ""}
    )
    for key in ("id", "type"):
        if part.get(key) is not None:
            call[key] = part[key]
    function = part.get("function") or {}
    if function.get("name") is not None:
        call["name"] = function["name"]
    call["arguments"] += function.get("arguments") or ""


def _choice_view(seen: dict[str, Any]) -> dict[str, Any]:
    calls = seen["tool_calls"]
    tool_calls = [
        {
            "index": index,
            "id": calls[index]["id"],
            "type": calls[index]["type"],
            "function": {"name": calls[index]["name"], "arguments": calls[index]["arguments"]},
        }
        for index in sorted(calls)
    ]
    return {**seen, "tool_calls": tool_calls}
