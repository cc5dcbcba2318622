"""The gateway's OpenAPI 3.1 document, served without auth at ``GET /openapi.json``.

The routes vLLM's serving layer answers (``openai_routes``: ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/version``) are
described by the very pydantic models ``OpenAIRoutes`` validates requests with and vLLM answers
with (``OpenAIRoutes.models_of`` and ``answers_of``): their JSON Schemas (pydantic's
``TypeAdapter.json_schemas``) are the document's ``components/schemas``. Two kvpush facts are
written into the request schemas: ``model`` takes the gateway's served names only (any other
is a 404), and the generation routes take the ``kvpush_mode`` extension. kvpush's own routes
(``/health``, ``/ready``, ``/metrics``, ``/dashboard``, ``/dashboard/data``, this document) are
described briefly. Every error is OpenAI error JSON (``Error``); ``/v1/*`` needs a Bearer key
when the gateway has API keys. Limits that span fields (prompt + ``max_tokens`` within the
context, the chat template's roles) can not be written in JSON Schema; the gateway answers
them with a 400.

Threading model: ``build_document`` is a pure function; ``handler`` builds and encodes the
document once, when the routes are added, and its handler serves those bytes on the gateway's
event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec
from aiohttp import web

if TYPE_CHECKING:
    from kvpush.services.gateway.openai_routes import OpenAIRoutes

OPENAPI_VERSION: Final = "3.1.0"
BEARER: Final = "bearerAuth"
REF: Final = "#/components/schemas/{model}"

# the routes of vLLM's serving layer: (method, path, request model key or None, answer key)
VLLM_ROUTES: Final = (
    ("post", "/v1/completions", "completion", "completion"),
    ("post", "/v1/chat/completions", "chat", "chat"),
    ("post", "/tokenize", "tokenize", "tokenize"),
    ("post", "/detokenize", "detokenize", "detokenize"),
    ("get", "/v1/models", None, "models"),
    ("get", "/version", None, None),
)
GENERATION: Final = ("completion", "chat")
SUMMARIES: Final = {
    "completion": "Text completion (vLLM's CompletionRequest).",
    "chat": "Chat completion (vLLM's ChatCompletionRequest, the model's chat template).",
    "tokenize": "A prompt or chat as token ids, as vLLM tokenizes it.",
    "detokenize": "Token ids as text.",
    "models": "The served model names; 503 until the gateway is ready (as /ready).",
    None: "vLLM's version.",
}

ERROR_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
MODE_SCHEMA: Final[dict[str, Any]] = {
    "anyOf": [{"enum": ["push", "pull", "local"]}, {"type": "null"}],
    "description": "kvpush extension: how the prompt's KV reaches the decode worker "
    "(default: the gateway's --mode; short prompts local).",
}
_ERRORS: Final[dict[str, str]] = {
    "400": "Invalid request: bad JSON, or what vLLM's request models and serving layer refuse.",
    "401": "Missing or wrong API key (code invalid_api_key).",
    "404": "Unknown model.",
    "413": "Request body larger than the gateway's limit, or a prompt too large for the bus.",
    "429": "Too many requests in flight and queued (code rate_limit_exceeded); retry later.",
    "500": "Internal error (a bug): a bare message, never a stack trace.",
    "502": "The decode worker failed or was lost.",
    "503": "No live worker for this request, the bus is unavailable, the queue wait ran out, "
    "or the gateway is shutting down.",
    "504": "The request's deadline passed.",
}


def _schemas(routes: OpenAIRoutes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key -> schema or $ref) of the requests and answers, and every component schema."""
    import pydantic

    inputs: list[tuple[str, Any, Any]] = [
        (f"request:{key}", "validation", pydantic.TypeAdapter(model))
        for key, model in routes.models_of.items()
    ]
    inputs += [
        (f"answer:{key}", "serialization", pydantic.TypeAdapter(model))
        for key, model in routes.answers_of.items()
    ]
    refs, defs = pydantic.TypeAdapter.json_schemas(inputs, ref_template=REF)
    return {key: schema for (key, _), schema in refs.items()}, defs.get("$defs", {})


def _with_kvpush_fields(
    schema: dict[str, Any], served: Sequence[str], generation: bool
) -> dict[str, Any]:
    properties = dict(schema.get("properties", {}))
    if "model" in properties:
        properties["model"] = {
            "anyOf": [{"enum": [*served, ""]}, {"type": "null"}],
            "description": "A served model name (empty or absent: the first); any other is a 404.",
        }
    if generation:
        properties["kvpush_mode"] = MODE_SCHEMA
    return {**schema, "properties": properties}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(statuses: Sequence[str]) -> dict[str, Any]:
    return {
        status: _json(_ERRORS[status], {"$ref": REF.format(model="Error")}) for status in statuses
    }


def _vllm_operation(
    key: str | None, answer: dict[str, Any] | None, request: dict[str, Any] | None
) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": answer or {"type": "object"}}}
    if key in GENERATION:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    answers = "vLLM's answer (with `stream: true`, its events)." if key in GENERATION else "OK."
    ok: dict[str, Any] = {"description": answers, "content": content}
    if key in GENERATION:
        ok["headers"] = {
            "X-Request-Id": {
                "description": "The client's, else the answer's id.",
                "schema": {"type": "string"},
            }
        }
    if request is None:  # /v1/models and /version
        errors = ["503"] if key == "models" else []
    elif key in GENERATION:
        errors = ["400", "404", "413", "429", "500", "502", "503", "504"]
    else:
        errors = ["400", "404", "413"]
    operation: dict[str, Any] = {
        "summary": SUMMARIES[key],
        "tags": ["vLLM"],
        "responses": {"200": ok, **_errors(errors)},
    }
    if request is not None:
        operation["requestBody"] = {
            "required": True,
            "description": "JSON (read as JSON whatever the Content-Type says).",
            "content": {"application/json": {"schema": request}},
        }
    return operation


def _own_paths() -> dict[str, Any]:
    def plain(summary: str, kind: str) -> dict[str, Any]:
        content = {kind: {"schema": {"type": "string"}}}
        return {
            "get": {
                "summary": summary,
                "tags": ["kvpush"],
                "responses": {"200": {"description": summary, "content": content}},
            }
        }

    def json_get(summary: str, responses: dict[str, str]) -> dict[str, Any]:
        answers = {status: _json(text, {"type": "object"}) for status, text in responses.items()}
        return {"get": {"summary": summary, "tags": ["kvpush"], "responses": answers}}

    return {
        "/health": json_get("Liveness: the gateway answers.", {"200": "Alive."}),
        "/ready": json_get(
            "Readiness: NATS connected, a live worker of each required role, not draining.",
            {"200": "Ready.", "503": "Not ready; `missing` says why."},
        ),
        "/metrics": plain("Prometheus metrics (text format 0.0.4).", "text/plain"),
        "/dashboard": plain("Live dashboard page (polls /dashboard/data).", "text/html"),
        "/dashboard/data": json_get(
            "The dashboard's counters and recent requests.", {"200": "Counters and rows."}
        ),
        "/openapi.json": json_get("This document.", {"200": "OpenAPI 3.1."}),
    }


def build_document(
    routes: OpenAIRoutes, served: Sequence[str], *, secured: bool, max_body_bytes: int | None = None
) -> dict[str, Any]:
    """The gateway's OpenAPI 3.1 document; ``secured``: /v1/* need a Bearer API key."""
    refs, components = _schemas(routes)
    for key in routes.models_of:
        ref = refs[f"request:{key}"]
        for one in ref.get("anyOf", [ref]):  # /tokenize's is a union of two models
            name = one["$ref"].rsplit("/", 1)[-1]
            generation = key in GENERATION
            components[name] = _with_kvpush_fields(components[name], served, generation)
    components["Error"] = ERROR_SCHEMA
    paths = _own_paths()
    for method, path, request_key, answer_key in VLLM_ROUTES:
        request = refs.get(f"request:{request_key}") if request_key else None
        answer = refs.get(f"answer:{answer_key}") if answer_key else None
        operation = _vllm_operation(request_key or answer_key, answer, request)
        if secured and path.startswith("/v1/"):
            operation["security"] = [{BEARER: []}]
            operation["responses"].update(_errors(["401"]))
        paths[path] = {method: operation}
    limit = f" Request bodies over {max_body_bytes} bytes are a 413." if max_body_bytes else ""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "kvpush gateway",
            "version": "1",
            "summary": "OpenAI-compatible API of a prefill/decode-disaggregated LLM server.",
            "description": f"Serves {', '.join(f'`{n}`' for n in served)} with vLLM's serving "
            "layer; every error is OpenAI error JSON." + limit,
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                BEARER: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "One of the gateway's API keys (--api-key); required on /v1/*"
                    " only when the gateway has keys.",
                }
            },
        },
    }


def handler(
    routes: OpenAIRoutes, served: Sequence[str], *, secured: bool, max_body_bytes: int
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /openapi.json`` handler of one gateway (document built once, here)."""
    document = build_document(routes, served, secured=secured, max_body_bytes=max_body_bytes)
    body = msgspec.json.encode(document)

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi_json
