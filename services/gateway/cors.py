"""CORS for browsers calling the gateway from another origin (``--allowed-origin``, off by
default, as ``vllm serve``'s ``--allowed-origins``): ``install`` adds a middleware that answers
preflight ``OPTIONS`` requests of an allowed ``Origin`` (``*``: any), and a response-prepare
hook that adds ``Access-Control-Allow-Origin`` to every answer for one, streams included (the
hook runs before a stream sends its headers). Requests of other origins are left as they are.

Threading model: the gateway's event loop (aiohttp middleware and signal).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALLOWED_METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = "600"


def install(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS for ``origins`` (exact ``scheme://host[:port]`` strings, or ``*``) on ``app``."""
    any_origin = "*" in origins

    def allowed(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        return origin if origin is not None and (any_origin or origin in origins) else None

    @web.middleware
    async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        asks = request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
        if not asks or allowed(request) is None:
            return await handler(request)
        headers = request.headers.get("Access-Control-Request-Headers")
        response = web.Response(status=204)
        response.headers["Access-Control-Allow-Methods"] = ALLOWED_METHODS
        response.headers["Access-Control-Allow-Headers"] = headers or "Authorization, Content-Type"
        response.headers["Access-Control-Max-Age"] = MAX_AGE_S
        return response

    async def allow_origin(request: web.Request, response: web.StreamResponse) -> None:
        if (origin := allowed(request)) is not None:
            response.headers["Access-Control-Allow-Origin"] = "*" if any_origin else origin
            if not any_origin:
                response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)  # before auth: a preflight carries no API key
    app.on_response_prepare.append(allow_origin)
