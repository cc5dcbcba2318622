"""Aborts, deadlines, corrupted KV and a prefill engine that dies: blocks are freed on every
path, a late WRITE never lands in reused blocks, KV that is not what P computed is never used,
and decode still answers correctly by computing the prompt.

A slow prefill engine ("p1": the connector sleeps 400 ms after each of the tiny model's 2 layers
of the last prefill step) makes every race window wide enough to hit on purpose. Its transfers
named ``tx-corrupt-*`` get a bit of their KV flipped after P's checksum was taken, those named
``tx-stale-*`` a stale sender's WRITE into D's blocks after the real one (connector/vllm/
faults.py). The last test kills it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas import Abort, AbortAck, subjects
from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import DECODE_ID, connector_config, wait_for
from tests.integration.engine_proc import P_CORES, EngineProc, start_engine
from tests.integration.test_connector_integrity import integrity
from tests.integration.test_connector_vllm import BLOCK, MAX_TOKENS, prompt, reference, request

pytestmark = pytest.mark.engine

SLOW_ID = "p1"
LAYER_DELAY_S = 0.4
# The slow prefill holds a transfer that no abort ends for this long (far above the default):
# blocks freed within ABORT_WAIT_S can only have been freed by the abort.
TRANSFER_TIMEOUT_S = 600.0
ABORT_WAIT_S = 30.0
CORRUPT, STALE = "tx-corrupt-", "tx-stale-"  # transfer ids the slow prefill corrupts


@pytest.fixture(scope="module")
def slow_prefill(
    tiny_model: Path,
    nats_server: EmbeddedNats,
    engine_logs: Path,
    pd_engines: tuple[EngineProc, EngineProc],
) -> Iterator[EngineProc]:
    engine = start_engine(
        "P-slow",
        tiny_model,
        P_CORES,
        engine_logs,
        kv_transfer_config=connector_config(
            "prefill",
            SLOW_ID,
            nats_server.url,
            fault_layer_delay_ms=LAYER_DELAY_S * 1000,
            fault_corrupt_prefix=CORRUPT,
            fault_stale_write_prefix=STALE,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
        ),
    )
    yield engine
    engine.stop()


@pytest.fixture
def decode(pd_engines: tuple[EngineProc, EngineProc]) -> EngineProc:
    return pd_engines[1]


class Gateway:
    """Publishes what a gateway would (aborts) and records AbortAcks, from a thread of its own."""

    def __init__(self, url: str) -> None:
        self.acks: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, args=(url,), daemon=True).start()
        assert self._ready.wait(10)

    def _run(self, url: str) -> None:
        async def start() -> None:
            self.bus = await Bus.connect(BusConfig(url=url, name="test-gateway"))

            async def on_abort(subject: str, message: Any) -> None:
                if isinstance(message, AbortAck):
                    self.acks.append(message.transfer_id)

            await self.bus.subscribe(subjects.abort(DECODE_ID), on_abort)
            await self.bus.flush()

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()

    def abort(self, transfer_id: str, *workers: str) -> None:
        async def send() -> None:
            for worker in workers:
                await self.bus.publish(
                    subjects.abort(worker), Abort(transfer_id=transfer_id, sender="gw-test")
                )
            await self.bus.flush()

        asyncio.run_coroutine_threadsafe(send(), self._loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.bus.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def gateway(nats_server: EmbeddedNats) -> Iterator[Gateway]:
    gw = Gateway(nats_server.url)
    yield gw
    gw.close()


@pytest.fixture(autouse=True)
def no_leaked_blocks(slow_prefill: EngineProc, decode: EngineProc) -> Iterator[None]:
    engines = [e for e in (slow_prefill, decode)]
    start = [e.free_blocks() for e in engines]
    yield
    for engine, before in zip(engines, start, strict=True):
        if engine is slow_prefill and not engine._proc.is_alive():  # killed by the last test
            continue
        wait_for(
            lambda e=engine, b=before: e.free_blocks() == b,
            15.0,
            f"engine {engine.name} back to {before} free blocks",
        )


def kv(tid: str, mode: str = "push", **extra: Any) -> dict[str, Any]:
    return {
        "kvpush": {
            "transfer_id": tid,
            "prefill_id": SLOW_ID,
            "decode_id": DECODE_ID,
            "mode": mode,
            **extra,
        }
    }


def new_tid() -> str:
    return f"tx-f-{uuid.uuid4().hex[:12]}"


def test_abort_before_announcement_frees_prefill_blocks_at_once(
    slow_prefill: EngineProc, gateway: Gateway, rng: random.Random
) -> None:
    tid = new_tid()
    before = slow_prefill.free_blocks()
    slow_prefill.submit([request(f"p-{tid}", prompt(rng, 3 * BLOCK), 1, kv(tid))])
    wait_for(lambda: slow_prefill.free_blocks() < before, 5.0, "prefill holding blocks")
    gateway.abort(tid, SLOW_ID)
    (out,) = slow_prefill.collect([f"p-{tid}"])
    # freed by the abort: without it they stay held for the transfer timeout (600 s)
    wait_for(lambda: slow_prefill.free_blocks() == before, ABORT_WAIT_S, "blocks freed")
    assert out["error"] is None
    wait_for(lambda: tid in gateway.acks, 5.0, "AbortAck to decode")


def test_prefill_without_announcement_gives_up_at_the_deadline(
    slow_prefill: EngineProc, rng: random.Random
) -> None:
    tid = new_tid()
    deadline_ms = int((time.time() + 2.0) * 1000)
    (out,) = slow_prefill.generate(
        [request(f"p-{tid}", prompt(rng, 2 * BLOCK), 1, kv(tid, deadline_ms=deadline_ms))]
    )
    assert out["error"] is None  # the block release is checked by no_leaked_blocks


@pytest.mark.parametrize(
    "abort_after_s", [0.2, LAYER_DELAY_S + 0.2], ids=["after-announcement", "during-push"]
)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_abort_mid_transfer_frees_both_sides_and_no_late_write_lands(
    slow_prefill: EngineProc,
    decode: EngineProc,
    gateway: Gateway,
    rng: random.Random,
    abort_after_s: float,
    mode: str,
) -> None:
    tid = new_tid()
    ids = prompt(rng, 3 * BLOCK + 10)
    decode.submit([request(f"d-{tid}", ids, kv=kv(tid, mode), salt=tid)])
    time.sleep(0.1)  # D has announced (push) / is waiting for KvReady (pull)
    slow_prefill.submit([request(f"p-{tid}", ids, 1, kv(tid, mode))])
    time.sleep(abort_after_s)
    # The client is gone: D's engine ends the request first (queued before any step that could
    # fall back and recompute), then the gateway's Abort reaches both workers.
    decode.abort(f"d-{tid}")
    gateway.abort(tid, SLOW_ID, DECODE_ID)
    # Reuse D's blocks at once with other prompts: a late WRITE of the aborted transfer would
    # corrupt them while P's remaining layers are still being computed.
    others = [prompt(rng, 3 * BLOCK + 10) for _ in range(3)]
    expected = [reference(decode, other) for other in others]
    (d_out,) = decode.collect([f"d-{tid}"])
    assert d_out["finish_reason"] == "abort", d_out  # the abort ended it, not a recompute
    wait_for(lambda: tid in gateway.acks, 10.0, "P's AbortAck: no WRITE in flight or to come")
    slow_prefill.collect([f"p-{tid}"])
    time.sleep(LAYER_DELAY_S * 2)  # P's last layer would have been written by now
    assert [reference(decode, other) for other in others] == expected


def through_slow_prefill(
    slow_prefill: EngineProc, decode: EngineProc, tid: str, ids: list[int], mode: str
) -> dict[str, Any]:
    """One P/D request (D announces or waits first, P streams its layers); D's result."""
    params = kv(tid, mode)
    decode.submit([request(f"d-{tid}", ids, kv=params, salt=tid)])
    slow_prefill.submit([request(f"p-{tid}", ids, 1, params)])
    (d_out,) = decode.collect([f"d-{tid}"])
    (p_out,) = slow_prefill.collect([f"p-{tid}"])
    assert d_out["error"] is None and p_out["error"] is None, (d_out, p_out)
    return d_out


def checked_first(
    slow_prefill: EngineProc, decode: EngineProc, rng: random.Random, mode: str
) -> dict[str, int]:
    """A clean transfer through the same engines: verified, the KV used. Its counts are the
    ones a faulty transfer after it must move."""
    ids = prompt(rng, 2 * BLOCK + 20)
    d_out = through_slow_prefill(slow_prefill, decode, new_tid(), ids, mode)
    assert d_out["kv_landed_ns"] > 0 and integrity(d_out)["outcome"] == "verified", d_out
    return integrity(d_out)["counts"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kv_corrupted_after_its_checksum_is_caught_and_decode_recomputes(
    slow_prefill: EngineProc, decode: EngineProc, rng: random.Random, mode: str
) -> None:
    """One bit of a layer's first block flips after P took the checksum, before D gets the
    bytes (push: the last layer's, before its WRITE; pull: every layer's, before KvReady). D
    must not use that KV."""
    before = checked_first(slow_prefill, decode, rng, mode)
    ids = prompt(rng, 2 * BLOCK + 50)
    expected = reference(decode, ids)
    d_out = through_slow_prefill(
        slow_prefill, decode, f"{CORRUPT}{uuid.uuid4().hex[:12]}", ids, mode
    )
    assert d_out["token_ids"] == expected  # one engine's answer: D computed the prompt
    assert d_out["kv_landed_ns"] == 0, d_out  # ... itself: what landed was not taken
    seen = integrity(d_out)
    assert seen["outcome"] == "mismatch", seen
    assert seen["counts"]["mismatch"] == before.get("mismatch", 0) + 1, (before, seen)
    assert seen["counts"]["verified"] == before["verified"], (before, seen)


def test_a_stale_write_into_the_blocks_after_the_real_one_is_caught(
    slow_prefill: EngineProc, decode: EngineProc, rng: random.Random
) -> None:
    """After the push wrote layer 0 into D's blocks, a stale sender (an older allocation of
    those blocks) WRITEs layer 0 again, from P's blocks in reverse order, and sends its done
    notice. D must drop that notice (else it would take the KV as landed before the last layer
    and with nothing to check) and must find the misplaced blocks (the same bytes, in other
    places: a plain sum would not) before the request runs."""
    before = checked_first(slow_prefill, decode, rng, "push")
    ids = prompt(rng, 3 * BLOCK + 10)
    expected = reference(decode, ids)
    d_out = through_slow_prefill(
        slow_prefill, decode, f"{STALE}{uuid.uuid4().hex[:12]}", ids, "push"
    )
    assert d_out["token_ids"] == expected
    assert d_out["kv_landed_ns"] == 0, d_out
    seen = integrity(d_out)
    assert seen["outcome"] == "mismatch", seen
    assert seen["counts"]["mismatch"] == before.get("mismatch", 0) + 1, (before, seen)
    assert seen["counts"]["stale"] == before.get("stale", 0) + 1, (before, seen)


def test_decode_falls_back_when_prefill_dies_mid_way(
    slow_prefill: EngineProc, decode: EngineProc, rng: random.Random
) -> None:
    """P is killed while computing; D's transfer expires, P never acks, D's probe finds P gone,
    D computes the prompt itself and answers token-exact. Must run last: it kills P-slow."""
    tid = new_tid()
    ids = prompt(rng, 2 * BLOCK + 50)
    expected = reference(decode, ids)
    address = slow_prefill.connector_info["side_channel"]
    deadline_ms = int((time.time() + 2.5) * 1000)
    params = kv(tid, deadline_ms=deadline_ms, prefill_address=address)
    decode.submit([request(f"d-{tid}", ids, kv=params, salt=tid)])
    time.sleep(0.1)
    slow_prefill.submit([request(f"p-{tid}", ids, 1, params)])
    time.sleep(0.2)
    slow_prefill.kill()
    (d_out,) = decode.collect([f"d-{tid}"], timeout=60)
    assert d_out["error"] is None
    assert d_out["kv_landed_ns"] == 0, d_out  # no KV landed: D computed the prompt itself
    assert d_out["token_ids"] == expected
    assert len(d_out["token_ids"]) == MAX_TOKENS
