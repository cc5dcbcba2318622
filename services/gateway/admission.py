"""The gateway's admission: at most ``max_inflight`` generation requests served at once, up to
``max_queued`` more waiting (first come, first served) for at most ``queue_timeout_s``.

A request past both bounds is refused at once with 429 ``rate_limit_exceeded``; one that waited
its whole ``queue_timeout_s`` gets 503 ``queue_timeout``; both carry ``Retry-After``. So a burst
(``vllm bench serve --request-rate inf``: every prompt at once) waits instead of failing, and
only a flood past the queue's bound is refused.

Threading model: the gateway's event loop only (an ``asyncio.Semaphore``, fair in arrival order).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvpush.services.gateway.errors import ApiError


class Admission:
    """Slots for requests being served, and a bounded FIFO of requests waiting for one."""

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_inflight, self.max_queued = max_inflight, max_queued
        self.queue_timeout_s = queue_timeout_s
        self._slots = asyncio.Semaphore(max_inflight)
        self.in_flight = 0  # holding a slot
        self.waiting = 0  # queued for one

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with``; ApiError 429/503 when refused."""
        if not self._slots.locked():
            await self._slots.acquire()  # a free slot: taken at once, without suspending
        else:
            await self._wait_for_slot()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._slots.release()

    async def _wait_for_slot(self) -> None:
        """Queue for a slot (counted in ``waiting`` before suspending, so a burst sees every
        request ahead of it); ApiError 429 past ``max_queued``, 503 after ``queue_timeout_s``."""
        if self.waiting >= self.max_queued:
            raise ApiError(
                429,
                f"too many requests: {self.in_flight} in flight and {self.waiting} queued"
                f" (limits {self.max_inflight} and {self.max_queued}); retry later",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise ApiError(
                503,
                f"no capacity within {self.queue_timeout_s:g} s (queued behind"
                f" {self.in_flight} requests in flight); retry later",
                type_="service_unavailable",
                code="queue_timeout",
            ) from None
        finally:
            self.waiting -= 1
