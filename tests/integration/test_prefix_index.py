"""The prefix index end to end: a decode worker as deployed (``kvpush decode``, its engine's KV
cache events on) and the gateway's ``PrefixIndex`` fed over a real nats-server, wired as
``services/gateway/app.py`` wires it (``kvpush.v1.cache.*.*``, a ``CacheSync`` at start).

After a prompt ran once, the index says the worker holds its whole blocks (and nothing of
another prompt); the second run of it is a prefix-cache hit on the worker; a second index that
starts later (a restarted gateway) gets the same from the worker's snapshot. The engine runs
as each deployment runs it: in the worker's process (``--engine-core thread``, the CPU
default), in its own engine-core process (``process``, the CUDA default) and with two
tensor-parallel ranks (one publisher whatever the TP: the scheduler's).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvpush.schemas import subjects
from kvpush.schemas.messages import CacheSync
from kvpush.services.gateway.prefix_index import PrefixIndex
from kvpush.services.gateway.routing import DECODE_ONLY
from kvpush.services.natsd import EmbeddedNats
from tests.integration.worker_proc import Observer, WorkerProc, kill_all

pytestmark = pytest.mark.engine

D = "cd0"
SETUPS = {  # worker flags and cores
    "thread": (("--engine-core", "thread"), [1]),
    "process": (("--engine-core", "process"), [1]),
    "tp2": (("--tp", "2"), [0, 1]),
}
BLOCK = 128  # the worker's default block size


@pytest.fixture(scope="module", params=list(SETUPS))
async def decode_worker(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    nats_server: EmbeddedNats,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[Observer, WorkerProc]]:
    logs = tmp_path_factory.mktemp("prefix-index-logs")
    flags, cores = SETUPS[request.param]
    proc = WorkerProc("decode", D, nats_server.url, tiny_model, cores, logs, *flags)
    observer = await Observer.connect(nats_server.url, "gw-prefix")
    try:
        proc.start()
        await observer.wait_ready([proc])
        yield observer, proc
        assert proc.stop() == 0, proc.tail()
    finally:
        kill_all([proc])
        await observer.close()


async def test_the_index_knows_the_whole_blocks_a_worker_holds_after_one_request(
    decode_worker: tuple[Observer, WorkerProc],
) -> None:
    observer, proc = decode_worker
    index = PrefixIndex()
    bus = observer.bus
    await bus.subscribe(subjects.cache_events_all(), index.on_message)
    await bus.flush()
    await bus.publish(subjects.cache_sync(), CacheSync(sender="gw-prefix"))
    rng = random.Random(32)
    prompt = [rng.randrange(10, 500) for _ in range(2 * BLOCK + 50)]
    other = [rng.randrange(10, 500) for _ in range(2 * BLOCK + 50)]

    await observer.wait_for(lambda: index.stats.messages > 0, 30, "the worker's snapshot")
    assert index.blocks_of(D) == 0
    assert index.matched_tokens(prompt, [D]) == {}

    first = await observer.generate(observer.event(DECODE_ONLY, D, prompt, mode="local"))
    assert first[-1].finish_reason is not None, proc.tail()
    await observer.wait_for(
        lambda: index.matched_tokens(prompt, [D]) == {D: 2 * BLOCK}, 30, "the prompt's blocks"
    )
    assert index.block_size == BLOCK
    assert index.matched_tokens(other, [D]) == {}
    assert index.matched_tokens(prompt, ["someone-else"]) == {}

    second = await observer.generate(observer.event(DECODE_ONLY, D, prompt, mode="local"))
    assert second[-1].num_cached_tokens == 2 * BLOCK  # the worker's cache had what it said
    assert index.stats.gaps == 0

    restarted = PrefixIndex()  # a gateway that starts now learns it from the snapshot
    await bus.subscribe(subjects.cache_events_all(), restarted.on_message)
    await bus.flush()
    await bus.publish(subjects.cache_sync(), CacheSync(sender="gw-later", workers=[D]))
    await observer.wait_for(
        lambda: restarted.matched_tokens(prompt, [D]) == {D: 2 * BLOCK}, 30, "the snapshot"
    )
    assert restarted.matched_tokens(other, [D]) == {}
