"""Fuzzing the gateway's HTTP surface against fake workers on the session's real nats-server:
its OpenAPI document, and schemathesis driven by that document.

- ``/openapi.json`` is valid OpenAPI 3.1, documents every route the gateway serves, and its
  request schemas are those of the pydantic models the gateway validates with (vLLM's); with
  API keys, exactly the ``/v1/*`` operations are secured (and answer 401 without a key).
- schemathesis, from that document: every operation, positive and (with a body) negative
  cases; no 5xx, documented status codes, content types, headers and bodies (SSE events too).
  Afterwards the gateway still serves a valid request and has nothing in flight.

Raw HTTP fuzzing (bytes, JSON, edge-case literals, absurd values) is in
``test_gateway_fuzz_raw``; shared helpers in ``gateway_fuzz_helpers``. The fake decode worker
answers every request with one chunk, so valid requests are cheap. All generation is
deterministic (``derandomize=True``, no example database).

Threading model: each test's gateway and fake workers run on the test's event loop; the
synchronous clients (schemathesis' ``requests`` transport) run on one worker thread
(``asyncio.to_thread``), so the loop keeps serving while they wait.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import requests
import schemathesis
from hypothesis import given
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.gateway_fakes import Stack
from tests.integration.gateway_fuzz_helpers import (
    CHAT,
    COMPLETIONS,
    TIMEOUT_S,
    StackFactory,
    Statuses,
    assert_still_serving,
    fuzz,
    one_chunk_reply,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def served_routes(s: Stack) -> set[tuple[str, str]]:
    """(method, path) of every route the gateway's app serves (HEAD: aiohttp's, per GET)."""
    runner = s.gateway._runner
    assert runner is not None
    return {
        (route.method, route.resource.canonical)
        for route in runner.app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }


# ---- /openapi.json ---------------------------------------------------------------------------
async def test_openapi_document_is_valid_and_documents_every_route(stack: StackFactory) -> None:
    s = await stack(reply=one_chunk_reply)
    status, doc = await s.call("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(doc).validate()  # the OpenAPI 3.1 meta-schema
    served = served_routes(s)
    documented = {(m.upper(), path) for path, item in doc["paths"].items() for m in item}
    assert documented == served
    assert "security" not in json.dumps(doc["paths"])  # no API keys: no auth anywhere
    scheme = doc["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    schemas = doc["components"]["schemas"]
    request = schemas["CompletionRequest"]["properties"]
    assert request["model"]["anyOf"][0]["enum"] == ["kvpush-tiny", ""]  # "": the first
    assert {"n", "logprobs", "echo", "response_format", "structured_outputs"} <= set(request)
    for path in (COMPLETIONS, CHAT):
        operation = doc["paths"][path]["post"]
        ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        model = s.gateway.api.routes.models_of["chat" if path == CHAT else "completion"]
        fields = {info.alias or name for name, info in model.model_fields.items()}
        # the document's fields are the validating model's, plus the kvpush_mode extension
        assert set(schemas[ref.rsplit("/", 1)[1]]["properties"]) == fields | {"kvpush_mode"}
        responses = operation["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert {"400", "404", "413", "429", "502", "503", "504"} <= set(responses)


async def test_openapi_document_needs_no_key_and_marks_v1_secured(stack: StackFactory) -> None:
    s = await stack(reply=one_chunk_reply, api_keys=("k1",), max_body_bytes=1 << 20)
    status, doc = await s.call("GET", "/openapi.json")
    assert status == 200
    for path, item in doc["paths"].items():
        for operation in item.values():
            secured = operation.get("security") == [{"bearerAuth": []}]
            assert secured == path.startswith("/v1/"), path
            assert ("401" in operation["responses"]) == secured, path
    statuses = await asyncio.to_thread(
        run_schemathesis, s.gateway.url, 5, s.gateway.model.served_name
    )  # without the key
    assert {status for (label, status) in statuses if " /v1/" in label} == {401}, statuses
    others = {status for (label, status) in statuses if " /v1/" not in label}
    assert 200 in others and others <= {200, 400}, statuses  # /tokenize's negative cases: 400


# ---- schemathesis ----------------------------------------------------------------------------
def run_operation(
    operation: Any,
    mode: GenerationMode,
    url: str,
    session: requests.Session,
    examples: int,
    statuses: Statuses,
    served: str,
) -> None:
    """Up to ``examples`` cases of one operation, each answer checked; counts (label, status)."""
    label = f"{operation.label} {mode.value}"
    # No negative_data_rejection: vLLM's pydantic models accept more than their JSON Schema says
    # (lax mode takes "5" for 5; chat content parts are TypedDicts that take other keys), and
    # the gateway answers as they validate. Negative cases still may not 5xx or break shapes.
    checks = CHECKS

    @fuzz(examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        started = time.monotonic()
        response = case.call(base_url=url, session=session, timeout=TIMEOUT_S)
        assert time.monotonic() - started < TIMEOUT_S
        statuses[label, response.status_code] += 1
        case.validate_response(response, checks=checks)
        if response.status_code == 404:  # a body naming another model, as vLLM answers
            assert mode is GenerationMode.NEGATIVE, (case.body, response.text)
            assert response.json()["error"]["type"] == "NotFoundError", response.text
            assert isinstance(case.body, dict) and case.body.get("model") != served, case.body

    check()


def run_schemathesis(url: str, examples: int, served: str) -> Statuses:
    """Every operation of url/openapi.json, positive and (with a body) negative cases."""
    statuses: Statuses = collections.Counter()
    with requests.Session() as session:
        # from_dict, not from_url: from_url leaves out the operation that served the document
        document = session.get(url + "/openapi.json", timeout=TIMEOUT_S).json()
        schema = schemathesis.openapi.from_dict(document)
        schema.validate()
        for result in schema.get_all_operations():
            operation = result.ok()
            run_operation(
                operation, GenerationMode.POSITIVE, url, session, examples, statuses, served
            )
            if operation.body:
                run_operation(
                    operation, GenerationMode.NEGATIVE, url, session, examples, statuses, served
                )
    return statuses


async def test_schemathesis_finds_no_server_error_or_schema_violation(
    stack: StackFactory,
) -> None:
    s = await stack(reply=one_chunk_reply, worker_lease_s=30.0, max_body_bytes=1 << 20)
    statuses = await asyncio.to_thread(
        run_schemathesis, s.gateway.url, 50, s.gateway.model.served_name
    )
    ran = {label.rsplit(" ", 1)[0] for label, _ in statuses}
    assert ran == {f"{method} {path}" for method, path in served_routes(s)}, statuses
    # Schema-valid cases mostly get vLLM's 400 for what JSON Schema can not say (its request
    # models' cross-field rules: prompt or prompt_embeds, structured outputs, logprob bounds,
    # the chat template's roles); some are served. How many depends on the generated cases,
    # which vary with the served model's name (its path) even in a derandomized run.
    for path in (COMPLETIONS, CHAT):
        assert statuses[f"POST {path} positive", 200] >= 1, statuses
        # Invalid ones get 400, or 404 model_not_found when only the model breaks the schema's
        # enum (checked per case in run_operation): the body is parsed before the model lookup.
        label = f"POST {path} negative"
        negative = {status: n for (name, status), n in statuses.items() if name == label}
        assert negative.get(400, 0) >= 25 and set(negative) <= {200, 400, 404}, statuses
    await assert_still_serving(s)
