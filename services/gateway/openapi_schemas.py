"""Component schemas of the gateway's OpenAPI 3.1 document (``openapi_doc`` assembles it).

This module owns ``components.schemas``: the request bodies exactly as
``openai_api.parse_request`` accepts them (types, bounds, nulls meaning "absent", the refused
features' only accepted neutral values), the JSON responses, the OpenAI error body of every
4xx/5xx and the SSE events. ``schemas`` builds them from one gateway's model (served name,
vocabulary size, context length); ``ref`` names one. Event schemas follow Open API 3.2's
reading of ``text/event-stream``, which schemathesis also applies to 3.1: each describes ONE
event (``data`` holds a JSON chunk, an error body, or ``[DONE]``).

Threading model: none; pure functions that build plain dicts.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

from kvpush.schemas.messages import MAX_PROMPT_TOKENS, FinishReason, TransferMode
from kvpush.schemas.sampling import MAX_OUTPUT_TOKENS, MAX_STOP_STRINGS, MAX_TOKEN_ID
from kvpush.services.gateway import openai_api as api

if TYPE_CHECKING:
    from kvpush.services.gateway.model import ModelInfo

# What a finished request reports; "error" never reaches a client as a finish reason (502).
FINISH_REASONS: Final = [r.value for r in FinishReason if r is not FinishReason.ERROR]
CHAT_ROLES: Final = ("system", "user", "assistant")  # the roles every chat template knows


def ref(name: str) -> dict[str, str]:
    """A JSON reference to the component schema ``name``."""
    return {"$ref": "#/components/schemas/" + name}


def _nullable(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """An optional field: JSON null means the same as leaving it out (as in parse_request)."""
    return {"anyOf": [schema, {"type": "null"}], "description": description}


def _int(lo: int, hi: int, description: str) -> dict[str, Any]:
    return _nullable({"type": "integer", "minimum": lo, "maximum": hi}, description)


def _neutral(values: tuple[Any, ...]) -> dict[str, Any]:
    """A refused feature: only its neutral value(s) or null are accepted, anything else is 400."""
    shown: list[Any] = []
    for value in values:  # 0 and 0.0 are one JSON value
        if value is not None and value not in shown:
            shown.append(value)
    if not shown:
        return {"type": "null", "description": "Not supported by this server: only null."}
    return _nullable(
        {"enum": shown},
        f"Not supported by this server: only {json.dumps(shown)[1:-1]} or null.",
    )


def _token_ids(vocab_size: int, max_items: int) -> dict[str, Any]:
    return {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": min(vocab_size - 1, MAX_TOKEN_ID)},
        "minItems": 1,
        "maxItems": max_items,
    }


def _sampling_fields(model: ModelInfo) -> dict[str, Any]:
    """The fields both generation endpoints share (parse_request's common part)."""
    stop_item = {"type": "string", "maxLength": 256}
    fields: dict[str, Any] = {
        "model": _nullable(
            {"type": "string", "enum": [model.served_name]},
            "The served model (GET /v1/models); any other name is a 404 model_not_found.",
        ),
        "temperature": _nullable(
            {"type": "number", "minimum": 0, "maximum": 2}, "Sampling temperature; 0 is greedy."
        ),
        "top_p": _nullable(
            {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "Nucleus sampling mass."
        ),
        "top_k": _int(-1, 1_000_000, "vLLM extension: top-k sampling; -1 and 0 disable it."),
        "seed": _int(-api.INT64, api.INT64 - 1, "Sampling seed (a signed 64-bit integer)."),
        "min_tokens": _int(
            0,
            MAX_OUTPUT_TOKENS,
            "vLLM extension: tokens generated before EOS or stop may end the request; at most "
            "max_tokens (else 400).",
        ),
        "ignore_eos": _nullable({"type": "boolean"}, "vLLM extension: generate past EOS."),
        "stop": _nullable(
            {
                "anyOf": [
                    stop_item,
                    {
                        "type": "array",
                        "items": stop_item,
                        "contains": {"type": "string", "minLength": 1},
                        "minContains": 0,
                        "maxContains": MAX_STOP_STRINGS,
                    },
                ]
            },
            f"Stop strings: one, or a list; empty strings are ignored, at most "
            f"{MAX_STOP_STRINGS} non-empty ones of <= 256 characters.",
        ),
        "stop_token_ids": _nullable(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
                "maxItems": 256,
            },
            "vLLM extension: token ids that end the request.",
        ),
        "stream": _nullable(
            {"type": "boolean"},
            "Answer as Server-Sent Events (text/event-stream), ending with `data: [DONE]`.",
        ),
        "stream_options": _nullable(
            {
                "type": "object",
                "properties": {
                    "include_usage": _nullable(
                        {"type": "boolean"},
                        "With stream: a last chunk with empty choices and the usage.",
                    )
                },
            },
            "Streaming options.",
        ),
        "response_format": _nullable(
            {
                "type": "object",
                "properties": {"type": {"const": "text"}},
                "required": ["type"],
                "additionalProperties": False,
            },
            "Only {'type': 'text'} is supported.",
        ),
        "kvpush_mode": _nullable(
            {"type": "string", "enum": [m.value for m in TransferMode]},
            "kvpush extension: how the KV cache travels from prefill to decode (push, pull) or "
            "decode alone (local); default: the gateway's choice by prompt length.",
        ),
    }
    for name, neutral in api._NEUTRAL.items():
        fields[name] = _neutral(neutral)
    return fields


def _completion_request(model: ModelInfo) -> dict[str, Any]:
    ids = _token_ids(model.vocab_size, MAX_PROMPT_TOKENS)
    prompt = {
        "description": (
            "ONE prompt: a string, a list of token ids (< the vocabulary size "
            f"{model.vocab_size}), or a batch of exactly one of those."
        ),
        "anyOf": [
            {"type": "string"},
            ids,
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": ids, "minItems": 1, "maxItems": 1},
        ],
    }
    properties = {
        "prompt": prompt,
        "max_tokens": _int(
            1,
            MAX_OUTPUT_TOKENS,
            "Tokens to generate (default 16); prompt + max_tokens must fit the context length "
            f"{model.max_model_len} (else 400).",
        ),
        "logprobs": _neutral((None,)),
        **_sampling_fields(model),
    }
    return {
        "type": "object",
        "description": "Unknown fields are ignored (as vLLM does).",
        "required": ["prompt"],
        "properties": dict(sorted(properties.items())),
    }


def _chat_request(model: ModelInfo) -> dict[str, Any]:
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }
    message = {
        "type": "object",
        "properties": {
            "role": {
                "type": "string",
                "enum": list(CHAT_ROLES),
                "description": "Other roles go to the model's chat template, which may refuse "
                "them (400).",
            },
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": part},
                    {"type": "null"},
                ],
                "description": "Text, or text parts (joined by newlines); null is empty.",
            },
        },
        "required": ["role"],
    }
    limit = (
        "Tokens to generate (default: the rest of the context length "
        f"{model.max_model_len}); prompt + this must fit it (else 400)."
    )
    properties = {
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": _int(1, MAX_OUTPUT_TOKENS, limit),
        "max_tokens": _int(1, MAX_OUTPUT_TOKENS, "Legacy name of max_completion_tokens."),
        "logprobs": _neutral((None, False)),
        **_sampling_fields(model),
    }
    return {
        "type": "object",
        "description": "Unknown fields are ignored (as vLLM does).",
        "required": ["messages"],
        "properties": dict(sorted(properties.items())),
    }


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


def _finish(*, nullable: bool) -> dict[str, Any]:
    return {"enum": [*FINISH_REASONS, *([None] if nullable else [])]}


def _head(kind: str) -> dict[str, Any]:
    return {
        "id": {"type": "string", "pattern": "^(chat)?cmpl-[0-9a-f]{32}$"},
        "object": {"const": kind},
        "created": {"type": "integer"},
        "model": {"type": "string"},
    }


def _choice(field: str, content: dict[str, Any], *, final: bool) -> dict[str, Any]:
    """One choice, its text in ``field``; a streamed one (not ``final``) may not be finished."""
    return _object(
        {
            "index": {"const": 0},
            field: content,
            "logprobs": {"type": "null"},
            "finish_reason": _finish(nullable=not final),
        }
    )


def _completion(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {
            **_head(kind),
            "choices": {"type": "array", "items": choice, "minItems": 1},
            "usage": ref("Usage"),
        }
    )


def _chunk(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    body = _object(
        {
            **_head(kind),
            "choices": {"type": "array", "items": choice, "maxItems": 1},
            "usage": {"anyOf": [ref("Usage"), {"type": "null"}]},
        },
        ["id", "object", "created", "model", "choices"],
    )
    body["description"] = (
        "One streamed chunk; with stream_options.include_usage, `usage` is null on every "
        "chunk but the last one, which has empty `choices` and the usage."
    )
    return body


def _event(chunk_name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": (
            "ONE Server-Sent Event (the schema of each event, as Open API 3.2's itemSchema): "
            "`data` is a JSON chunk, an error body after the stream began (then [DONE]), or "
            "the final `[DONE]`."
        ),
        "properties": {
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "then": True,
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [ref(chunk_name), ref("Error")]},
                },
            },
            "event": {"const": "message"},
        },
        "required": ["data"],
    }


def schemas(model: ModelInfo) -> dict[str, Any]:
    """Every component schema of one gateway's document (``components.schemas``), by name."""
    count = {"type": "integer", "minimum": 0}
    usage = _object({"prompt_tokens": count, "completion_tokens": count, "total_tokens": count})
    text = {"type": "string"}
    assistant = {"role": {"const": "assistant"}, "content": text}
    message, delta = _object(assistant), _object(assistant, ["content"])
    return {
        "CompletionRequest": _completion_request(model),
        "ChatCompletionRequest": _chat_request(model),
        "Usage": usage,
        "Completion": _completion("text_completion", _choice("text", text, final=True)),
        "ChatCompletion": _completion("chat.completion", _choice("message", message, final=True)),
        "CompletionChunk": _chunk("text_completion", _choice("text", text, final=False)),
        "ChatCompletionChunk": _chunk(
            "chat.completion.chunk", _choice("delta", delta, final=False)
        ),
        "CompletionEvent": _event("CompletionChunk"),
        "ChatCompletionEvent": _event("ChatCompletionChunk"),
        "Error": {
            "type": "object",
            "description": "OpenAI's error body; every 4xx/5xx answer is one (never a trace).",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string", "examples": ["invalid_request_error"]},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "integer", "null"]},
                    },
                    "required": ["message", "type", "param", "code"],
                    "additionalProperties": False,
                }
            },
            "required": ["error"],
            "additionalProperties": False,
        },
        "ModelList": _object(
            {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": _object(
                        {
                            "id": {"type": "string"},
                            "object": {"const": "model"},
                            "created": {"type": "integer"},
                            "owned_by": {"type": "string"},
                            "root": {"type": "string"},
                            "max_model_len": {"type": "integer", "minimum": 1},
                        }
                    ),
                },
            }
        ),
        "Health": _object({"status": {"const": "ok"}, "gateway_id": {"type": "string"}}),
        "Ready": _object(
            {
                "ready": {"type": "boolean"},
                "missing": {"type": "array", "items": {"type": "string"}},
                "workers": {
                    "type": "object",
                    "additionalProperties": {"type": "integer", "minimum": 0},
                },
                "gateway_id": {"type": "string"},
                "model": {"type": "string"},
            }
        ),
        "DashboardData": _object(
            {
                "parts": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "string"}},
                },
                "counters": {
                    "type": "object",
                    "additionalProperties": {"type": ["number", "null"]},
                },
                "requests": {"type": "array", "items": {"type": "object"}},
            }
        ),
    }
