"""The gateway's HTTP errors: ``ApiError`` and the OpenAI error body every error is answered with.

``ApiError(status, message, ...)`` is raised anywhere in a request's handling (admission, the
bus generation, vLLM's validation as ``openai_routes`` translates it); the HTTP server's
middleware answers it with ``error_body``'s JSON (``{"error": {message, type, param, code}}``)
and, for 429 and 503, a ``Retry-After`` header. ``json_response`` is how the gateway's own
routes answer JSON.

Threading model: none (values and pure functions).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_json = msgspec.json.Encoder()


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
    ) -> None:
        super().__init__(message)
        self.status = status
        # 429 and 503 tell the client when to come back (Retry-After, seconds)
        self.retry_after_s = 1 if status in (429, 503) else None
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
