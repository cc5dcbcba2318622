"""``kvpush up --tp 2``: every worker runs two tensor-parallel ranks (vLLM's multiprocess
executor, a process and a connector worker half per rank), and the stack answers over HTTP
exactly as it does in mode local, with the KV moved rank to rank by push and by pull. Then
``--prefill-tp 2 --decode-tp 1``: both P ranks write their KV heads into halves of D's blocks.

Runs after test_openai_e2e.py has stopped the session's stack (its last test), so only this
stack's engines share the box's two cores. They are many for two cores (four or three rank
processes, two workers with their engine threads, the gateway): a worker's loop can miss its
heartbeats for over a second there, past the default 1.5 s lease, and then what it held is
released and the transfer falls back, as it should. These tests are about moving KV rank to rank,
not about that, so the workers state a lease of ``LEASE_S`` (``--lease-s``, the documented knob
for a busy host).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import UpStack, run_up
from tests.e2e.test_openai_e2e import assert_kv_received, complete
from tests.integration.worker_proc import Observer

pytestmark = pytest.mark.engine


STACKS = {"tp2": ("--tp", "2"), "p2-d1": ("--prefill-tp", "2", "--decode-tp", "1")}
RANKS = {"tp2": {"prefill": 2, "decode": 2}, "p2-d1": {"prefill": 2, "decode": 1}}
LEASE_S = "6"  # see the module docstring


@pytest.fixture(scope="module", params=list(STACKS))
def tp_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UpStack, dict[str, int]]]:
    """A stack and its ranks per role."""
    name = request.param
    log_dir = tmp_path_factory.mktemp(f"kvpush-up-{name}")
    with run_up(log_dir, *STACKS[name], env={"KVPUSH_LEASE_S": LEASE_S}) as stack:
        yield stack, RANKS[name]


async def test_every_worker_announces_a_side_channel_per_rank(
    tp_stack: tuple[UpStack, dict[str, int]],
) -> None:
    stack, ranks = tp_stack
    observer = await Observer.connect(stack.nats_url, "gw-tp-observer")
    try:
        await observer.wait_for(lambda: len(observer.beats) >= 2, 30.0, "both workers' beats")
        for worker_id, beats in observer.beats.items():
            channels = beats[-1].side_channels or [beats[-1].side_channel]
            role = "prefill" if worker_id.startswith("prefill") else "decode"
            assert len(set(channels)) == ranks[role], (worker_id, channels)
            assert beats[-1].side_channel == channels[0]
            assert beats[-1].lease_ms == int(float(LEASE_S) * 1000)  # the env reached it
    finally:
        await observer.close()


async def test_push_and_pull_give_the_local_answer(
    tp_stack: tuple[UpStack, dict[str, int]], rng: random.Random
) -> None:
    stack, _ = tp_stack
    client = stack.client()
    for length in (60, 300):  # under one block, and three blocks (D caches after local)
        ids = [rng.randrange(10, 2000) for _ in range(length)]
        ref = await complete(client, ids, "local", max_tokens=16)
        assert ref.choices[0].text
        for mode in ("push", "pull"):
            got = await complete(client, ids, mode, max_tokens=16)
            assert got.choices[0].text == ref.choices[0].text, (length, mode)
            await assert_kv_received(stack, [(got.id, mode)])
