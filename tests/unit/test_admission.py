"""The gateway's admission under a burst: every request of the burst starts before any of them
holds a slot, and still no more than ``max_inflight`` run and ``max_queued`` wait."""

from __future__ import annotations

import asyncio

from kvpush.services.gateway.admission import Admission
from kvpush.services.gateway.errors import ApiError


async def test_a_burst_gets_the_slots_then_the_queue_then_429() -> None:
    admission = Admission(max_inflight=2, max_queued=1, queue_timeout_s=30)
    release = asyncio.Event()
    outcomes: list[str] = []

    async def request() -> None:
        try:
            async with admission.slot():
                outcomes.append("served")
                await release.wait()
        except ApiError as exc:
            outcomes.append(f"{exc.status} {exc.code} retry {exc.retry_after_s}")

    tasks = [asyncio.create_task(request()) for _ in range(5)]  # all start in one loop turn
    while len(outcomes) < 4:  # two served, two refused; one waits
        await asyncio.sleep(0)
    assert sorted(outcomes) == ["429 rate_limit_exceeded retry 1"] * 2 + ["served"] * 2
    assert (admission.in_flight, admission.waiting) == (2, 1)
    release.set()
    await asyncio.gather(*tasks)
    assert outcomes.count("served") == 3 and (admission.in_flight, admission.waiting) == (0, 0)


async def test_a_queued_request_gets_503_after_the_queue_timeout() -> None:
    admission = Admission(max_inflight=1, max_queued=4, queue_timeout_s=0.05)
    async with admission.slot():
        try:
            async with admission.slot():
                raise AssertionError("no slot was free")
        except ApiError as exc:
            assert (exc.status, exc.code, exc.retry_after_s) == (503, "queue_timeout", 1)
    assert (admission.in_flight, admission.waiting) == (0, 0)
