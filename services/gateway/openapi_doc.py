"""The gateway's OpenAPI 3.1 document, served without auth at ``GET /openapi.json``.

This module owns the machine-readable description of the gateway's HTTP surface: every route
``handlers.GatewayApi.add_routes`` serves (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/ready``, ``/metrics``, ``/dashboard``, ``/dashboard/data`` and
this document), each operation's responses and status codes (JSON or the SSE stream, the
OpenAI error body of every 4xx/5xx), the document's info and the Bearer scheme, required on
``/v1/*`` only when the gateway has API keys. The component schemas (request bodies, responses,
the error body, SSE events) live in ``openapi_schemas``.

The document is built per gateway (``build_document``): the served model name, the vocabulary
size (token ids must be below it) and the context length come from its model folder. Limits
that span fields (prompt + ``max_tokens`` within the context, ``min_tokens`` <= ``max_tokens``,
the chat template's roles) can not be written in JSON Schema; the gateway answers them with a
400, which every generation operation documents.

Threading model: ``build_document`` is a pure function; ``handler`` builds and encodes the
document once, when the routes are added, and its handler serves those bytes on the gateway's
event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec
from aiohttp import web

from kvpush.services.gateway import openapi_schemas
from kvpush.services.gateway.openapi_schemas import ref

if TYPE_CHECKING:
    from kvpush.services.gateway.config import GatewayConfig
    from kvpush.services.gateway.model import ModelInfo

OPENAPI_VERSION: Final = "3.1.0"
BEARER: Final = "bearerAuth"


def _components(model: ModelInfo) -> dict[str, Any]:
    return {
        "schemas": openapi_schemas.schemas(model),
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
    return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}


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
                "application/json": {"schema": ref(answer)},
                "text/event-stream": {"schema": ref(event)},
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
            "content": {"application/json": {"schema": ref(request)}},
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
        "responses": {
            "200": _json("The one served model.", ref("ModelList")),
            **unauthorized,
            "503": _error("Not ready, as /ready says (workers starting or lost, the bus)."),
        },
    }
    paths: dict[str, Any] = {
        "/v1/completions": {"post": {**completions, **security}},
        "/v1/chat/completions": {"post": {**chat, **security}},
        "/v1/models": {"get": {**models, **security}},
        "/health": {
            "get": {
                "summary": "Liveness: the gateway answers.",
                "tags": ["Operations"],
                "responses": {"200": _json("Alive.", ref("Health"))},
            }
        },
        "/ready": {
            "get": {
                "summary": "Readiness: NATS connected, a live prefill and decode worker, not "
                "draining.",
                "tags": ["Operations"],
                "responses": {
                    "200": _json("Ready.", ref("Ready")),
                    "503": _json("Not ready; `missing` says why.", ref("Ready")),
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
                "responses": {"200": _json("Counters and rows.", ref("DashboardData"))},
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


# the routes vLLM's serving layer answers with ``--frontend vllm`` (openai_routes.py)
VLLM_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
    }
)


def with_vllm(document: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """``document`` whose OpenAI routes are described by vLLM's own document (the vLLM
    frontend answers them: its request models and shapes); kvpush's other routes stay."""
    paths = {p: item for p, item in document["paths"].items() if p not in VLLM_PATHS}
    security = document["paths"]["/v1/models"]["get"].get("security")  # API keys on /v1/*
    for path, item in vllm["paths"].items():
        if path in VLLM_PATHS:
            paths[path] = {
                method: {**op, "security": security} if security and path.startswith("/v1/") else op
                for method, op in item.items()
            }
    ours = document["components"]["schemas"]
    theirs = vllm.get("components", {}).get("schemas", {})
    components = {**document["components"], "schemas": {**ours, **theirs}}
    return {**document, "paths": dict(sorted(paths.items())), "components": components}


def handler(
    model: ModelInfo, config: GatewayConfig, vllm: dict[str, Any] | None = None
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /openapi.json`` handler of one gateway (document built once, here; with
    ``vllm``, the vLLM frontend's document, its OpenAI routes are vLLM's)."""
    document = build_document(
        model, secured=bool(config.api_keys), max_body_bytes=config.max_body_bytes
    )
    body = msgspec.json.encode(document if vllm is None else with_vllm(document, vllm))

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi_json
