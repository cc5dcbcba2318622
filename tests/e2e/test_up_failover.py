"""``kvpush up --prefill 2 --decode 2`` through a ``kill -9`` of one worker of each role.

Requests stream while a decode worker is killed mid-answer, then while a prefill worker is
killed mid-push. Every request answers 200 with the text of an unbroken greedy run: those on the
dead decode worker moved to the other one (the gateway's migration, from the prompt plus the
tokens already sent), those whose prefill worker died were computed by their decode worker. ``up``
starts each killed worker again (a new epoch), every worker, the restarted ones too, ends with
all of its blocks free, and the socket file a killed worker's engine left is gone once it runs
again.

The workers run with injected slowness (``KVPUSH_FAULT_STEP_DELAY_MS`` per engine step,
``KVPUSH_FAULT_LAYER_DELAY_MS`` per layer of a prefill) so that the kills land while answers
stream and pushes run, however fast the box. Runs after test_openai_e2e.py has stopped the
session's stack (its last test), so only this stack's engines share the box's two cores.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.benchmarks.soak import WORDS  # made-up words of the tiny model
from kvpush.schemas import subjects
from kvpush.services.workers.events_socket import events_endpoint
from tests.e2e.conftest import UpStack, run_up
from tests.e2e.test_openai_e2e import greedy
from tests.integration.http_client import metric
from tests.integration.worker_proc import Observer

pytestmark = pytest.mark.engine

WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
MAX_TOKENS = 120  # x 20 ms per step: an answer streams for seconds
REQUESTS = 4
SLOW = {"KVPUSH_FAULT_STEP_DELAY_MS": "20", "KVPUSH_FAULT_LAYER_DELAY_MS": "150"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    log_dir = tmp_path_factory.mktemp("kvpush-up-failover")
    with run_up(log_dir, "--prefill", "2", "--decode", "2", env=SLOW) as up:
        yield up


@pytest.fixture
async def observer(stack: UpStack) -> AsyncIterator[Observer]:
    watch = await Observer.connect(stack.nats_url, "gw-failover-observer")
    await watch.wait_for(lambda: all(watch.beats.get(w) for w in WORKERS), 60, "every worker")
    yield watch
    await watch.close()


def prompts(rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(24)) for _ in range(REQUESTS)]


async def stream(stack: UpStack, prompt: str, first: asyncio.Event | None = None) -> str:
    """The text of a streamed greedy answer in mode push (``first`` set at its first token)."""
    answer = await stack.client().completions.create(
        prompt=prompt, stream=True, **greedy("push", MAX_TOKENS, ignore_eos=True)
    )
    texts: list[str] = []
    async for chunk in answer:
        if chunk.choices:
            texts.append(chunk.choices[0].text or "")
            if first is not None and texts[-1]:
                first.set()
    return "".join(texts)


async def idle_again(stack: UpStack, observer: Observer, restarted: str, epoch: int) -> None:
    """``up`` started the killed worker again (a new epoch), and every worker has every block
    free and nothing in flight."""
    await observer.fresh_beat(restarted, lambda b: b.epoch != epoch, 240)
    for worker_id in WORKERS:
        total = observer.last_beat(worker_id).total_blocks
        await observer.fresh_beat(
            worker_id, lambda b, t=total: b.free_blocks == t and b.in_flight == 0, 60
        )


def events_socket_of(worker_id: str, pid: int) -> Path:
    """The KV events socket file of worker process ``pid``: a ``kill -9`` leaves it; the
    restarted worker removes it (``events_socket.remove_stale_sockets``)."""
    endpoint = events_endpoint(worker_id, pid, tempfile.gettempdir())
    return Path(endpoint.removeprefix("ipc://"))


async def references(stack: UpStack, texts: list[str]) -> list[str]:
    return list(await asyncio.gather(*(stream(stack, t) for t in texts)))


async def test_a_decode_worker_killed_mid_answer(
    stack: UpStack, observer: Observer, rng: random.Random
) -> None:
    texts = prompts(rng)
    unbroken = await references(stack, texts)
    before = await metric(stack.url, "kvpush_gateway_migrations_total", lost="decode")
    routed_to: list[str] = []  # the decode worker of each request the gateway publishes

    async def on_request(msg: Any) -> None:
        routed_to.append(msg.subject.rsplit(".", 1)[-1])

    sub = await observer.bus.client.subscribe(f"{subjects.ROOT}.req.*.*", cb=on_request)
    await observer.bus.flush()
    started = [asyncio.Event() for _ in texts]
    pairs = zip(texts, started, strict=True)
    answers = [asyncio.create_task(stream(stack, t, e)) for t, e in pairs]
    await asyncio.gather(*(e.wait() for e in started))  # every answer streams
    await observer.wait_for(lambda: len(routed_to) >= len(texts), 30, "every request's event")
    await sub.unsubscribe()
    # the router places each prompt where its prefix is cached (the references' worker): kill
    # the decode worker that holds most of these answers, whichever one that is
    victim = max(sorted(set(routed_to)), key=routed_to.count)
    epoch, pid = observer.last_beat(victim).epoch, stack.worker_pid(victim)
    os.kill(pid, signal.SIGKILL)
    assert events_socket_of(victim, pid).exists()  # left behind by the kill
    assert await asyncio.gather(*answers) == unbroken  # no error, no token lost or repeated
    assert await metric(stack.url, "kvpush_gateway_migrations_total", lost="decode") > before
    await idle_again(stack, observer, victim, epoch)
    assert not events_socket_of(victim, pid).exists()


async def test_a_prefill_worker_killed_mid_push(
    stack: UpStack, observer: Observer, rng: random.Random
) -> None:
    texts = prompts(rng)
    unbroken = await references(stack, texts)
    pushing = asyncio.Event()

    async def on_blocks(msg: Any) -> None:
        pushing.set()  # a decode worker announced its blocks to prefill-0

    sub = await observer.bus.client.subscribe(subjects.blocks("prefill-0"), cb=on_blocks)
    await observer.bus.flush()
    answers = [asyncio.create_task(stream(stack, t)) for t in texts]
    await pushing.wait()
    await sub.unsubscribe()
    epoch, pid = observer.last_beat("prefill-0").epoch, stack.worker_pid("prefill-0")
    os.kill(pid, signal.SIGKILL)
    assert events_socket_of("prefill-0", pid).exists()
    assert await asyncio.gather(*answers) == unbroken
    await idle_again(stack, observer, "prefill-0", epoch)
    assert not events_socket_of("prefill-0", pid).exists()
