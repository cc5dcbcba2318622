"""services/workers/peers.py: a worker's view of its peers across its own loop's stall."""

from __future__ import annotations

import asyncio
import time

from kvpush.schemas.messages import WorkerRole
from kvpush.services.membership import Member
from kvpush.services.workers.peers import PeerWatch
from tests.unit.beats import beat

D = WorkerRole.DECODE


async def test_a_tick_after_this_loop_stalled_judges_no_one_until_the_beats_are_read() -> None:
    watch = PeerWatch(D, lease_s=0.4)
    left: list[Member] = []
    watch.on_leave(left.append)
    watch.view.observe(beat(D, "d0", lease_ms=400, sent_at_ms=10_000))
    watch._task = asyncio.create_task(watch._tick())  # what start() runs, without a bus
    try:
        await asyncio.sleep(0.15)  # ticks pass as usual
        time.sleep(1.0)  # this loop stalls past the peer's lease (blocking, on purpose)
        await asyncio.sleep(0.05)  # the late tick runs first ...
        assert not left
        # ... then the beats the peer sent meanwhile, read late
        watch.view.observe(beat(D, "d0", lease_ms=400, sent_at_ms=10_400))
        assert not left
        deadline = time.monotonic() + 30.0
        while not left:  # then silent: a tick on time finds it gone, as ever
            assert time.monotonic() < deadline, "a silent peer never left"
            await asyncio.sleep(0.05)
    finally:
        await watch.stop()
