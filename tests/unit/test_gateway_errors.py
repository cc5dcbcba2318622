"""The gateway's HTTP errors (``errors``): OpenAI error bodies, when to retry, JSON answers."""

from __future__ import annotations

from kvpush.services.gateway.errors import ApiError, json_response


def test_api_errors_are_openai_error_json_and_429_503_say_when_to_retry() -> None:
    error = ApiError(503, "no workers", type_="service_unavailable", code="no_workers")
    assert error.body() == {
        "error": {
            "message": "no workers",
            "type": "service_unavailable",
            "param": None,
            "code": "no_workers",
        }
    }
    assert (error.retry_after_s, ApiError(429, "busy").retry_after_s) == (1, 1)
    assert ApiError(400, "bad", param="prompt").retry_after_s is None
    response = json_response(error.body(), 503)
    assert response.status == 503 and response.content_type == "application/json"
