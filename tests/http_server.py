"""A throwaway aiohttp server on 127.0.0.1 for tests that need a real HTTP peer (scripted fake
OpenAI servers in the benchmark's and the soak's client tests).

Threading model: runs on the test's event loop; ``serving`` cleans up on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_completions(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A fake OpenAI server whose ``POST /v1/completions`` is ``handler``; yields its base URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with serving(app) as base_url:
        yield base_url
