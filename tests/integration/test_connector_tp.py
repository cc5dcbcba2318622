"""Tensor parallelism: P and D engines of TP 2 (vLLM's multiprocess executor, one worker process
and one connector worker half per rank, each with its own NIXL agent and bus connection).

Rank r of P moves its shard of the KV heads into rank r of D. Every answer must equal D
computing the prompt alone, D must report the KV landed (a silent recompute fails), the bus must
show one push (or KvReady) per rank, and the swap tests prove the moved KV was used. A P and a D
of different TP (2 -> 1 and 1 -> 2) split or merge the KV heads of each block: the same swap
test and token identity, push and pull. Every test ends with every engine's free blocks back
where they started: vLLM frees a transfer's blocks only once *every* rank reported it, so a
rank that leaked its side of a transfer would hold them.
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
from kvpush.schemas import Abort, AbortAck, KvPushed, KvReady, subjects
from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import (
    DECODE_ID,
    PREFILL_ID,
    connector_config,
    start_pair,
    wait_for,
)
from tests.integration.engine_proc import EngineProc, start_engine
from tests.integration.test_connector_vllm import BLOCK, prompt, reference, request
from tests.integration.test_first_token import swap

pytestmark = pytest.mark.engine
P_TP, D_TP = "p-tp2", "d-tp2"
TP_CORES = [0, 1]  # each engine: rank 0 on core 0, rank 1 on core 1


@pytest.fixture(scope="module")
def tp_engines(
    tiny_model: Path, nats_server: EmbeddedNats, engine_logs: Path
) -> Iterator[tuple[EngineProc, EngineProc]]:
    names = (("P-tp2", P_TP, TP_CORES), ("D-tp2", D_TP, TP_CORES))
    engines = start_pair(tiny_model, nats_server.url, engine_logs, names, tensor_parallel_size=2)
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture
def engines(
    tp_engines: tuple[EngineProc, EngineProc], pd_engines: tuple[EngineProc, EngineProc]
) -> Iterator[dict[str, EngineProc]]:
    """Every engine by worker id; each ends the test with the free blocks it started with."""
    by_id = {P_TP: tp_engines[0], D_TP: tp_engines[1], PREFILL_ID: pd_engines[0]}
    by_id[DECODE_ID] = pd_engines[1]
    start = {wid: engine.free_blocks() for wid, engine in by_id.items()}
    yield by_id
    for wid, engine in by_id.items():
        wait_for(
            lambda e=engine, b=start[wid]: e.free_blocks() == b,
            15.0,
            f"engine {engine.name} back to {start[wid]} free blocks",
        )


class Observer:
    """Collects every message on ``subject`` (a thread with its own bus connection)."""

    def __init__(self, url: str, subject: str) -> None:
        self.messages: list[Any] = []
        self._stop = threading.Event()
        ready = threading.Event()

        async def listen() -> None:
            self.bus = bus = await Bus.connect(BusConfig(url=url, name="tp-observer"))

            async def on_message(_subject: str, message: Any) -> None:
                self.messages.append(message)

            await bus.subscribe(subject, on_message)
            await bus.flush()
            ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.02)
            await bus.close()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(listen()), daemon=True
        )
        self._thread.start()
        assert ready.wait(10), "observer did not subscribe"

    def publish(self, subject: str, message: Any) -> None:
        """Publish ``message`` from the observer's connection (as a gateway would)."""

        async def send() -> None:
            await self.bus.publish(subject, message)
            await self.bus.flush()

        asyncio.run_coroutine_threadsafe(send(), self._loop).result(10)

    def of(self, kind: type, transfer_id: str) -> list[Any]:
        return [m for m in self.messages if isinstance(m, kind) and m.transfer_id == transfer_id]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def kv(tid: str, prefill_id: str, decode_id: str, mode: str) -> dict[str, Any]:
    return {
        "kvpush": {
            "transfer_id": tid,
            "prefill_id": prefill_id,
            "decode_id": decode_id,
            "mode": mode,
        }
    }


def run_pd(
    prefill: EngineProc,
    decode: EngineProc,
    ids: tuple[list[int], list[int]],
    tid: str,
    params: dict[str, Any],
) -> dict[str, Any]:
    """P prefills ``ids[0]`` and D decodes ``ids[1]`` with one transfer; D's output."""
    p_ids, d_ids = ids
    prefill.submit([request(f"p-{tid}", p_ids, max_tokens=1, kv=params)])
    decode.submit([request(f"d-{tid}", d_ids, kv=params, salt=f"s-{tid}")])
    (d_out,) = decode.collect([f"d-{tid}"])
    (p_out,) = prefill.collect([f"p-{tid}"])
    assert p_out["error"] is None, p_out
    assert d_out["error"] is None, d_out
    return d_out


def test_every_rank_registers_its_own_side_channel(
    tp_engines: tuple[EngineProc, EngineProc],
) -> None:
    for engine in tp_engines:
        ranks = engine.ranks
        assert [r["rank"] for r in ranks] == [0, 1] and {r["tp_size"] for r in ranks} == {2}
        assert len({r["side_channel"] for r in ranks}) == 2
        assert engine.connector_info["side_channel"] == ranks[0]["side_channel"]


PAIRS = [(P_TP, D_TP), (P_TP, DECODE_ID), (PREFILL_ID, D_TP)]  # P's TP -> D's: 2-2, 2-1, 1-2
PAIR_IDS = ["2-to-2", "2-to-1", "1-to-2"]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("prefill_id", "decode_id"), PAIRS, ids=PAIR_IDS)
def test_tp_swap_decode_answers_from_every_rank_s_moved_kv(
    engines: dict[str, EngineProc],
    nats_server: EmbeddedNats,
    rng: random.Random,
    mode: str,
    prefill_id: str,
    decode_id: str,
) -> None:
    """P prefills A; D is told B (same length and last token) with A's transfer: D answers as
    if it had seen A only if every rank's heads landed where D keeps them. 2-to-2: rank r into
    rank r; 2-to-1: both P ranks write their head into their half of each D block (D counts
    two notices); 1-to-2: each half of P's blocks goes to one D rank."""
    prefill, decode = engines[prefill_id], engines[decode_id]
    a = prompt(rng, 2 * BLOCK + 40)
    b = [*prompt(rng, len(a) - 1), a[-1]]
    expected_a, expected_b = reference(decode, a), reference(decode, b)
    assert expected_a != expected_b
    subject = subjects.kv_done(decode_id) if mode == "push" else subjects.kv_ready(decode_id)
    observer = Observer(nats_server.url, subject)
    tid = f"tx-tp-{uuid.uuid4().hex[:12]}"
    kind = KvPushed if mode == "push" else KvReady
    p_ranks = len(prefill.ranks)
    try:
        d_out = run_pd(prefill, decode, (a, b), tid, kv(tid, prefill_id, decode_id, mode))
        wait_for(lambda: len(observer.of(kind, tid)) == p_ranks, 10.0, "a report per P rank")
    finally:
        observer.close()
    assert d_out["token_ids"] == expected_a
    assert d_out["kv_landed_ns"] > 0, d_out
    reports = observer.of(kind, tid)
    assert sorted((m.rank, m.tp) for m in reports) == [(r, p_ranks) for r in range(p_ranks)]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("prefill_id", "decode_id"), PAIRS, ids=PAIR_IDS)
def test_every_decode_rank_continues_from_the_token_prefill_sampled(
    engines: dict[str, EngineProc],
    nats_server: EmbeddedNats,
    rng: random.Random,
    mode: str,
    prefill_id: str,
    decode_id: str,
) -> None:
    """P's first token (sent once, on the bus) reaches every D rank, and the request continues
    from it: D, handed a prompt with another last token, answers P's prompt's answer (the swap
    of tests/integration/test_first_token.py; a D rank that sampled the token itself would
    recompute that last token and answer otherwise)."""
    pair = (engines[prefill_id], engines[decode_id])
    swap(pair, nats_server.url, rng, mode, (prefill_id, decode_id))


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("prefill_id", "decode_id"), PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("length", [BLOCK + 5, 3 * BLOCK])
def test_tp_output_equals_one_engine(
    engines: dict[str, EngineProc],
    rng: random.Random,
    mode: str,
    prefill_id: str,
    decode_id: str,
    length: int,
) -> None:
    prefill, decode = engines[prefill_id], engines[decode_id]
    ids = prompt(rng, length)
    expected = reference(decode, ids)
    tid = f"tx-tpid-{uuid.uuid4().hex[:10]}"
    d_out = run_pd(prefill, decode, (ids, ids), tid, kv(tid, prefill_id, decode_id, mode))
    assert d_out["token_ids"] == expected
    assert d_out["kv_landed_ns"] > 0, d_out


# ---- faults at TP 2: a slow prefill engine (the connector sleeps per layer), killed at the end
SLOW_TP = "p-tp2-slow"
LAYER_DELAY_S = 0.4


@pytest.fixture(scope="module")
def slow_tp_prefill(
    tiny_model: Path, nats_server: EmbeddedNats, engine_logs: Path
) -> Iterator[EngineProc]:
    config = connector_config(
        "prefill",
        SLOW_TP,
        nats_server.url,
        fault_layer_delay_ms=LAYER_DELAY_S * 1000,
        transfer_timeout_s=600.0,  # only an abort (or P's death) can end its transfers in time
    )
    engine = start_engine(
        "P-tp2-slow",
        tiny_model,
        TP_CORES,
        engine_logs,
        tensor_parallel_size=2,
        kv_transfer_config=config,
    )
    yield engine
    engine.stop()


def test_tp2_abort_mid_transfer_is_acknowledged_by_every_rank_and_frees_every_block(
    engines: dict[str, EngineProc],
    slow_tp_prefill: EngineProc,
    nats_server: EmbeddedNats,
    rng: random.Random,
) -> None:
    decode = engines[D_TP]
    before = slow_tp_prefill.free_blocks()
    tid = f"tx-tpab-{uuid.uuid4().hex[:10]}"
    ids = prompt(rng, 3 * BLOCK + 10)
    params = kv(tid, SLOW_TP, D_TP, "push")
    acks = Observer(nats_server.url, subjects.abort(D_TP))
    gateway = Observer(nats_server.url, subjects.abort(SLOW_TP))  # only to publish from
    try:
        decode.submit([request(f"d-{tid}", ids, kv=params, salt=tid)])
        time.sleep(0.1)  # D has announced
        slow_tp_prefill.submit([request(f"p-{tid}", ids, max_tokens=1, kv=params)])
        time.sleep(LAYER_DELAY_S * 0.75)  # P is inside its first layer's delay
        decode.abort(f"d-{tid}")
        gateway.publish(subjects.abort(SLOW_TP), Abort(transfer_id=tid, sender="gw-test"))
        (d_out,) = decode.collect([f"d-{tid}"])
        assert d_out["finish_reason"] == "abort", d_out
        # generous: under the whole suite's load on 2 cores an ack once came after 15 s (a
        # correctness test: every rank acknowledges, every block comes back; not a timing one)
        wait_for(lambda: len(acks.of(AbortAck, tid)) == 2, 45.0, "an AbortAck per P rank")
        slow_tp_prefill.collect([f"p-{tid}"])
    finally:
        acks.close()
        gateway.close()
    assert sorted(a.rank for a in acks.of(AbortAck, tid)) == [0, 1]
    wait_for(lambda: slow_tp_prefill.free_blocks() == before, 15.0, "slow P's blocks back")


def test_tp2_decode_falls_back_when_prefill_dies_mid_way(
    engines: dict[str, EngineProc], slow_tp_prefill: EngineProc, rng: random.Random
) -> None:
    """P (both ranks) is killed while computing; D's ranks probe P's ranks, find them gone,
    and D computes the prompt itself, token-exact. Must run last: it kills P-tp2-slow."""
    decode = engines[D_TP]
    tid = f"tx-tpkill-{uuid.uuid4().hex[:10]}"
    ids = prompt(rng, 2 * BLOCK + 50)
    expected = reference(decode, ids)
    params = kv(tid, SLOW_TP, D_TP, "push")
    params["kvpush"]["deadline_ms"] = int((time.time() + 2.5) * 1000)
    params["kvpush"]["prefill_addresses"] = [r["side_channel"] for r in slow_tp_prefill.ranks]
    decode.submit([request(f"d-{tid}", ids, kv=params, salt=tid)])
    time.sleep(0.1)
    slow_tp_prefill.submit([request(f"p-{tid}", ids, max_tokens=1, kv=params)])
    time.sleep(0.2)
    slow_tp_prefill.kill()
    (d_out,) = decode.collect([f"d-{tid}"], timeout=60)
    assert d_out["error"] is None, d_out
    assert d_out["kv_landed_ns"] == 0, d_out  # no KV landed: D computed the prompt itself
    assert d_out["token_ids"] == expected
