"""A throwaway aiohttp server on 127.0.0.1 for tests that need a real HTTP peer (scripted fake
OpenAI servers in the benchmark's and the soak's client tests).

Threading model: runs on the test's event loop; ``serving`` cleans up on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

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
