"""The gateway's prefix-index wiring (``services/gateway/app.py``) over a real nats-server, with
fake workers: a worker that joins is asked for a snapshot, the gateway's index takes its cache
events, a worker that leaves is forgotten. (The real engine's events: test_prefix_index.py.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvpush.schemas import subjects
from kvpush.schemas.messages import CacheEvents, CacheSync, WorkerRole
from kvpush.schemas.prefix import block_hashes
from tests.integration.gateway_fakes import Stack, wait_until

StackFactory = Callable[..., Awaitable[Stack]]
BS = 16
PROMPT = list(range(100, 100 + 3 * BS + 5))


async def test_the_gateway_asks_joining_workers_for_snapshots_and_indexes_them(
    stack: StackFactory,
) -> None:
    s = await stack()
    bus = s.workers[0].bus
    asked: list[CacheSync] = []

    async def on_sync(subject: str, message: object) -> None:
        if isinstance(message, CacheSync):
            asked.append(message)

    await bus.subscribe(subjects.cache_sync(), on_sync)
    await bus.flush()
    decode = next(w for w in s.workers if w.role is WorkerRole.DECODE)
    index = s.gateway.prefix_index
    assert index.matched_tokens(PROMPT, [decode.worker_id]) == {}

    decode.epoch += 1  # a restart: the gateway's registry sees it join again
    await wait_until(lambda: any(decode.worker_id in m.workers for m in asked), 10.0)
    snapshot = CacheEvents(
        worker_id=decode.worker_id,
        epoch=decode.epoch,
        seq=0,
        block_size=BS,
        stored=block_hashes(PROMPT, BS)[:2],
        cleared=True,
        snapshot=True,
    )
    await bus.publish(subjects.cache_events(WorkerRole.DECODE, decode.worker_id), snapshot)
    want = {decode.worker_id: 2 * BS}
    await wait_until(lambda: index.matched_tokens(PROMPT, [decode.worker_id]) == want, 10.0)

    decode.beating = False  # silent past its lease: gone, and forgotten by the index
    await wait_until(lambda: s.gateway.registry.counts()["decode"] == 0, 10.0)
    assert index.blocks_of(decode.worker_id) == 0
