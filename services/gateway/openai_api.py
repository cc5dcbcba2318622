"""OpenAI-compatible request parsing, validation and response shapes (completions and chat).

``parse_request(endpoint, body)`` turns raw body bytes into a ``ParsedRequest`` or raises
``ApiError`` (always a 4xx: never anything else, whatever the bytes). ``prompt_token_ids``
tokenizes once, the same way vLLM's own server does (completions: the tokenizer's default,
which adds BOS; chat: the model's chat template with ``add_generation_prompt=True``, which adds
BOS itself; token-id prompts verbatim). ``sampling_spec`` checks the context length and builds
the ``SamplingSpec`` that travels in the RequestEvent. ``Shaper`` builds response bodies and
streaming chunks (OpenAI shapes, ``usage`` on the last one).

Accepted beyond the OpenAI basics: the vLLM extensions ``ignore_eos``, ``min_tokens``,
``top_k``, ``stop_token_ids`` and neutral ``repetition_penalty``/``min_p`` (what
``vllm bench serve`` sends), and ``kvpush_mode`` (push / pull / local). Features the engines
are not asked for (logprobs, echo, n > 1, penalties, logit bias) are refused with a 400 instead
of being silently ignored; unknown fields are ignored, as vLLM does.

Threading model: pure functions, except ``prompt_token_ids``, which calls the Hugging Face
tokenizer; the gateway runs it on its single tokenizer thread (HF fast tokenizers are not safe
to call from two threads at once).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from aiohttp import web

from kvpush.schemas.messages import MAX_PROMPT_TOKENS, TransferMode
from kvpush.schemas.sampling import (
    MAX_OUTPUT_TOKENS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    SamplingSpec,
)

INT64: Final = 2**63
_json = msgspec.json.Encoder()


class Endpoint(str, enum.Enum):
    COMPLETIONS = "text_completion"
    CHAT = "chat.completion"


class ApiError(Exception):
    """An error answered as OpenAI error JSON with ``status``; the message is client-safe."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        # 429 and 503 tell the client when to come back (Retry-After); 1 s unless given
        self.retry_after_s = retry_after_s or (1 if status in (429, 503) else None)
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request; ``max_tokens`` None means "the rest of the context" (chat)."""

    endpoint: Endpoint
    model: str | None
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingSpec fields but max_tokens
    stream: bool = False
    include_usage: bool = False
    mode: TransferMode | None = None


# ---- field readers -------------------------------------------------------------------------
def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _float(
    body: dict[str, Any], name: str, lo: float, hi: float, *, open_lo: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{name}' must be a number", name)
    if isinstance(value, float) and not math.isfinite(value):  # ints: any size, no float()
        raise _bad(f"'{name}' must be a number", name)
    if value > hi or value < lo or (open_lo and value == lo):
        low = f"> {lo}" if open_lo else f">= {lo}"
        raise _bad(f"'{name}' must be {low} and <= {hi}, got {value}", name)
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _bad(f"'{name}' must be a boolean", name)


def _token_ids(value: Any, name: str, max_len: int) -> list[int]:
    if not isinstance(value, list) or len(value) > max_len:
        raise _bad(f"'{name}' must be a list of at most {max_len} token ids", name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise _bad(f"'{name}' must hold integer token ids >= 0", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    items = [s for s in items if s]
    if len(items) > MAX_STOP_STRINGS or any(len(s) > 256 for s in items):
        raise _bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings of <= 256 chars", "stop")
    return items


def _refuse_unless(body: dict[str, Any], name: str, neutral: tuple[Any, ...]) -> None:
    """Refuse features the engines are not asked to do, unless the value is neutral."""
    value = body.get(name)
    if any(type(value) is type(n) and value == n for n in neutral):
        return
    raise _bad(f"'{name}'={str(value)[:40]!r} is not supported by this server", name)


def _mode(body: dict[str, Any]) -> TransferMode | None:
    value = body.get("kvpush_mode")
    if value is None:
        return None
    try:
        return TransferMode(value)
    except ValueError:
        raise _bad("'kvpush_mode' must be one of push, pull, local", "kvpush_mode") from None


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list", "messages")
    messages: list[dict[str, str]] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise _bad("each message needs a string 'role'", "messages")
        content = item.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise _bad("only text content parts are supported", "messages")
                if not isinstance(part.get("text"), str):
                    raise _bad("a text content part needs a string 'text'", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise _bad("message 'content' must be a string or a list of parts", "messages")
        messages.append({"role": item["role"], "content": content})
    return messages


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        return _token_ids(value, "prompt", MAX_PROMPT_TOKENS)
    raise _bad("'prompt' must be a string or a non-empty list of token ids (one prompt)", "prompt")


# ---- the parser ----------------------------------------------------------------------------
_NEUTRAL: Final[dict[str, tuple[Any, ...]]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
}


def parse_request(endpoint: Endpoint, body: bytes) -> ParsedRequest:
    """Parse and validate a request body; raise ``ApiError`` (4xx) on anything wrong."""
    try:
        data = msgspec.json.decode(body)
    except Exception:  # msgspec.DecodeError, RecursionError, ...: all mean bad JSON
        raise _bad("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise _bad("request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        _refuse_unless(data, name, neutral)
    logprobs_neutral = (None, False) if endpoint is Endpoint.CHAT else (None,)
    _refuse_unless(data, "logprobs", logprobs_neutral)
    fmt = data.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _bad("only response_format {'type': 'text'} is supported", "response_format")

    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    if endpoint is Endpoint.CHAT:
        messages = _messages(data.get("messages"))
        max_tokens = _int(data, "max_completion_tokens", 1, MAX_OUTPUT_TOKENS)
        legacy = _int(data, "max_tokens", 1, MAX_OUTPUT_TOKENS)  # checked even when unused
        if max_tokens is None:
            max_tokens = legacy
    else:
        if "prompt" not in data:
            raise _bad("'prompt' is required", "prompt")
        prompt = _prompt(data["prompt"])
        max_tokens = _int(data, "max_tokens", 1, MAX_OUTPUT_TOKENS)
        if max_tokens is None:
            max_tokens = 16  # OpenAI's default for completions

    sampling: dict[str, Any] = {}
    for name, value in (
        ("temperature", _float(data, "temperature", 0.0, 2.0)),
        ("top_p", _float(data, "top_p", 0.0, 1.0, open_lo=True)),
        ("top_k", _int(data, "top_k", -1, 1_000_000)),
        ("seed", _int(data, "seed", -INT64, INT64 - 1)),
        ("min_tokens", _int(data, "min_tokens", 0, MAX_OUTPUT_TOKENS)),
        ("ignore_eos", _bool(data, "ignore_eos")),
    ):
        if value is not None:
            sampling[name] = value
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1  # 0 means "disabled", as in vLLM
    sampling["stop"] = _stop(data)
    if data.get("stop_token_ids") is not None:
        sampling["stop_token_ids"] = _token_ids(data["stop_token_ids"], "stop_token_ids", 256)

    stream = bool(_bool(data, "stream"))
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    include_usage = bool(_bool(options or {}, "include_usage")) and stream
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        mode=_mode(data),
    )


def prompt_token_ids(request: ParsedRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt as token ids, tokenized like vLLM's server does; ``ApiError`` if unusable."""
    if request.messages is not None:
        try:
            ids = tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja2 errors from the template (unknown role, ...)
            message = f"chat template rejected the messages: {str(exc)[:200]}"
            raise _bad(message, "messages") from None
        if hasattr(ids, "keys"):  # a BatchEncoding from an older/newer transformers
            ids = ids["input_ids"]
        ids = list(ids)
    elif isinstance(request.prompt, str):
        ids = list(tokenizer(request.prompt)["input_ids"])
    else:
        ids = list(request.prompt or [])
        if any(token >= vocab_size for token in ids):
            raise _bad(f"prompt token ids must be < the vocabulary size {vocab_size}", "prompt")
    if not ids:
        raise _bad("the prompt is empty after tokenization", "prompt")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise _bad(f"the prompt has {len(ids)} tokens; at most {MAX_PROMPT_TOKENS}", "prompt")
    return ids


def sampling_spec(request: ParsedRequest, prompt_len: int, max_model_len: int) -> SamplingSpec:
    """The RequestEvent's sampling; 400 when prompt + max_tokens exceed the model's context."""
    room = max_model_len - prompt_len
    max_tokens = request.max_tokens if request.max_tokens is not None else room
    if room < 1 or max_tokens > room:
        raise _bad(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and {max_tokens} completion tokens were requested",
            "messages" if request.endpoint is Endpoint.CHAT else "prompt",
        )
    max_tokens = min(max_tokens, MAX_OUTPUT_TOKENS)
    if request.sampling.get("min_tokens", 0) > max_tokens:
        raise _bad("'min_tokens' must not exceed 'max_tokens'", "min_tokens")
    try:
        return msgspec.convert({**request.sampling, "max_tokens": max_tokens}, SamplingSpec)
    except msgspec.ValidationError as exc:  # belt and braces: the struct's own bounds
        raise _bad(f"invalid sampling parameters: {exc}") from None


# ---- response shapes -----------------------------------------------------------------------
def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class Shaper:
    """Response bodies and stream chunks of one request, in its endpoint's OpenAI shape."""

    endpoint: Endpoint
    request_id: str
    created: int
    model: str
    include_usage: bool = False

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self.endpoint.value + (".chunk" if chunk and self.endpoint is Endpoint.CHAT else "")
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def response(
        self, text: str, finish_reason: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.endpoint is Endpoint.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason)
        return {**self._head(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str, finish_reason: str | None, *, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.endpoint is Endpoint.CHAT:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason)
        body = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}
