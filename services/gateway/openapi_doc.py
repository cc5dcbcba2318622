"""The gateway's OpenAPI 3.1 document, served without auth at ``GET /openapi.json``.

This module owns the machine-readable description of the gateway's HTTP surface: every route
``handlers.GatewayApi.add_routes`` serves (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/ready``, ``/metrics``, ``/dashboard``, ``/dashboard/data`` and
this document), the request bodies exactly as ``openai_api.parse_request`` accepts them (types,
bounds, nulls meaning "absent", the refused features' only accepted neutral values), the
responses (completion and chat completion JSON, the SSE stream, the OpenAI error body of every
4xx/5xx) and the Bearer scheme, required on ``/v1/*`` only when the gateway has API keys.

The document is built per gateway (``build_document``): the served model name, the vocabulary
size (token ids must be below it) and the context length come from its model folder. Limits
that span fields (prompt + ``max_tokens`` within the context, ``min_tokens`` <= ``max_tokens``,
the chat template's roles) can not be written in JSON Schema; the gateway answers them with a
400, which every generation operation documents. Event streams follow Open API 3.2's reading of
``text/event-stream``, which schemathesis also applies to 3.1: the schema describes ONE event
(``data`` holds a JSON chunk, an error body, or ``[DONE]``).

Threading model: ``build_document`` is a pure function; ``handler`` builds and encodes the
document once, when the routes are added, and its handler serves those bytes on the gateway's
event loop.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec
from aiohttp import web

from kvpush.schemas.messages import (
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    FinishReason,
    TransferMode,
)
from kvpush.services.gateway import openai_api as api

if TYPE_CHECKING:
    from kvpush.services.gateway.app import GatewayConfig
    from kvpush.services.gateway.model import ModelInfo

OPENAPI_VERSION: Final = "3.1.0"
BEARER: Final = "bearerAuth"
_REF = "#/components/schemas/"
# What a finished request reports; "error" never reaches a client as a finish reason (502).
FINISH_REASONS: Final = [r.value for r in FinishReason if r is not FinishReason.ERROR]
CHAT_ROLES: Final = ("system", "user", "assistant")  # the roles every chat template knows


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


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


def _components(model: ModelInfo) -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    usage = _object({"prompt_tokens": count, "completion_tokens": count, "total_tokens": count})
    text_choice = _object(
        {
            "index": {"const": 0},
            "text": {"type": "string"},
            "logprobs": {"type": "null"},
            "finish_reason": _finish(nullable=False),
        }
    )
    chat_choice = _object(
        {
            "index": {"const": 0},
            "message": _object({"role": {"const": "assistant"}, "content": {"type": "string"}}),
            "logprobs": {"type": "null"},
            "finish_reason": _finish(nullable=False),
        }
    )
    text_delta = _object(
        {
            "index": {"const": 0},
            "text": {"type": "string"},
            "logprobs": {"type": "null"},
            "finish_reason": _finish(nullable=True),
        }
    )
    chat_delta = _object(
        {
            "index": {"const": 0},
            "delta": _object(
                {"role": {"const": "assistant"}, "content": {"type": "string"}}, ["content"]
            ),
            "logprobs": {"type": "null"},
            "finish_reason": _finish(nullable=True),
        }
    )
    chunk_usage = {"anyOf": [_ref("Usage"), {"type": "null"}]}

    def chunk(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        body = _object(
            {
                **_head(kind),
                "choices": {"type": "array", "items": choice, "maxItems": 1},
                "usage": chunk_usage,
            },
            ["id", "object", "created", "model", "choices"],
        )
        body["description"] = (
            "One streamed chunk; with stream_options.include_usage, `usage` is null on every "
            "chunk but the last one, which has empty `choices` and the usage."
        )
        return body

    def event(chunk_name: str) -> dict[str, Any]:
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
                        "contentSchema": {"anyOf": [_ref(chunk_name), _ref("Error")]},
                    },
                },
                "event": {"const": "message"},
            },
            "required": ["data"],
        }

    return {
        "schemas": {
            "CompletionRequest": _completion_request(model),
            "ChatCompletionRequest": _chat_request(model),
            "Usage": usage,
            "Completion": _object(
                {
                    **_head("text_completion"),
                    "choices": {"type": "array", "items": text_choice, "minItems": 1},
                    "usage": _ref("Usage"),
                }
            ),
            "ChatCompletion": _object(
                {
                    **_head("chat.completion"),
                    "choices": {"type": "array", "items": chat_choice, "minItems": 1},
                    "usage": _ref("Usage"),
                }
            ),
            "CompletionChunk": chunk("text_completion", text_delta),
            "ChatCompletionChunk": chunk("chat.completion.chunk", chat_delta),
            "CompletionEvent": event("CompletionChunk"),
            "ChatCompletionEvent": event("ChatCompletionChunk"),
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
        },
        "securitySchemes": {
            BEARER: {
                "type": "http",
                "scheme": "bearer",
                "description": "One of the gateway's API keys (--api-key); required on /v1/* "
                "only when the gateway has keys.",
            }
        },
    }


_ERRORS: Final[dict[str, str]] = {
    "400": "Invalid request: bad JSON, a wrong type or bound, an unsupported feature, or a "
    "prompt that does not fit the context length.",
    "401": "Missing or wrong API key (code invalid_api_key).",
    "404": "Unknown model (code model_not_found).",
    "413": "Request body larger than the gateway's limit, or a prompt too large for the bus.",
    "429": "Too many requests in flight (code rate_limit_exceeded); retry later.",
    "500": "Internal error (a bug): a bare message, never a stack trace.",
    "502": "The decode worker failed or was lost.",
    "503": "No live worker for this request, the bus is unavailable, or the gateway is "
    "shutting down.",
    "504": "The request's deadline passed.",
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation(
    summary: str, request: str, answer: str, event: str, secured: bool
) -> dict[str, Any]:
    statuses = [s for s in _ERRORS if secured or s != "401"]
    responses: dict[str, Any] = {
        "200": {
            "description": "The completion (JSON), or with `stream: true` its event stream.",
            "headers": {
                "X-Request-Id": {"description": "The response id.", "schema": {"type": "string"}}
            },
            "content": {
                "application/json": {"schema": _ref(answer)},
                "text/event-stream": {"schema": _ref(event)},
            },
        },
        **{status: _error(_ERRORS[status]) for status in statuses},
    }
    operation: dict[str, Any] = {
        "summary": summary,
        "tags": ["OpenAI"],
        "requestBody": {
            "required": True,
            "description": "JSON (read as JSON whatever the Content-Type says).",
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": responses,
    }
    return operation


def build_document(
    model: ModelInfo, *, secured: bool, max_body_bytes: int | None = None
) -> dict[str, Any]:
    """The gateway's OpenAPI 3.1 document; ``secured``: /v1/* need a Bearer API key."""
    security = {"security": [{BEARER: []}]} if secured else {}
    unauthorized = {"401": _error(_ERRORS["401"])} if secured else {}
    limit = f" Request bodies over {max_body_bytes} bytes are a 413." if max_body_bytes else ""
    completions = _generation(
        "Text completion (OpenAI legacy completions).",
        "CompletionRequest",
        "Completion",
        "CompletionEvent",
        secured,
    )
    chat = _generation(
        "Chat completion (the model's chat template).",
        "ChatCompletionRequest",
        "ChatCompletion",
        "ChatCompletionEvent",
        secured,
    )
    models = {
        "summary": "The served model.",
        "tags": ["OpenAI"],
        "responses": {"200": _json("The one served model.", _ref("ModelList")), **unauthorized},
    }
    paths: dict[str, Any] = {
        "/v1/completions": {"post": {**completions, **security}},
        "/v1/chat/completions": {"post": {**chat, **security}},
        "/v1/models": {"get": {**models, **security}},
        "/health": {
            "get": {
                "summary": "Liveness: the gateway answers.",
                "tags": ["Operations"],
                "responses": {"200": _json("Alive.", _ref("Health"))},
            }
        },
        "/ready": {
            "get": {
                "summary": "Readiness: NATS connected, a live prefill and decode worker, not "
                "draining.",
                "tags": ["Operations"],
                "responses": {
                    "200": _json("Ready.", _ref("Ready")),
                    "503": _json("Not ready; `missing` says why.", _ref("Ready")),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text format 0.0.4).",
                "tags": ["Operations"],
                "responses": {
                    "200": {
                        "description": "The metrics.",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/dashboard": {
            "get": {
                "summary": "Live dashboard page (HTML, polls /dashboard/data).",
                "tags": ["Operations"],
                "responses": {
                    "200": {
                        "description": "The page.",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/dashboard/data": {
            "get": {
                "summary": "The dashboard's counters and recent requests.",
                "tags": ["Operations"],
                "responses": {"200": _json("Counters and rows.", _ref("DashboardData"))},
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document.",
                "tags": ["Operations"],
                "responses": {"200": _json("OpenAPI 3.1.", {"type": "object"})},
            }
        },
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvpush gateway",
            "version": "1",
            "summary": "OpenAI-compatible API of a prefill/decode-disaggregated LLM server.",
            "description": (
                f"Serves `{model.served_name}` (context length {model.max_model_len} tokens). "
                "Every error is OpenAI error JSON. Integer fields take JSON integers written "
                "without a fraction or exponent (2.0 is a 400), which JSON Schema can not tell "
                "from 2." + limit
            ),
        },
        "paths": paths,
        "components": _components(model),
    }


def handler(
    model: ModelInfo, config: GatewayConfig
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /openapi.json`` handler of one gateway (document built once, here)."""
    body = msgspec.json.encode(
        build_document(model, secured=bool(config.api_keys), max_body_bytes=config.max_body_bytes)
    )

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi_json
