"""KVPushConnector between two real vLLM CPU engines (tiny model), real NIXL and nats-server.

Every P/D answer is compared with the same decode engine computing the prompt itself (greedy,
prefix cache kept apart with a cache salt) and must come with D's connector reporting the KV
landed (``kv_landed_ns``: a silent recompute on D fails the test); the swap tests prove the KV
really moved and was used; every test ends with both engines' free block counts back where they
started.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from typing import Any

import pytest

from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas import KvPushed, subjects
from kvpush.services import models
from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import DECODE_ID, PREFILL_ID
from tests.integration.engine_proc import EngineProc

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_leaked_blocks")]

BLOCK = 128
MAX_TOKENS = 8


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(length)]


def kv_params(transfer_id: str, mode: str, **extra: Any) -> dict[str, Any]:
    return {
        "kvpush": {
            "transfer_id": transfer_id,
            "prefill_id": PREFILL_ID,
            "decode_id": DECODE_ID,
            "mode": mode,
            **extra,
        }
    }


def request(
    rid: str,
    ids: list[int],
    max_tokens: int = MAX_TOKENS,
    kv: dict | None = None,
    salt: str | None = None,
) -> dict[str, Any]:
    return {
        "request_id": rid,
        "prompt_token_ids": ids,
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
        "kv_transfer_params": kv,
        "cache_salt": salt,
    }


def reference(decode: EngineProc, ids: list[int]) -> list[int]:
    """D computing the prompt alone, its prefix cache kept apart by a unique salt."""
    rid = f"ref-{uuid.uuid4().hex[:12]}"
    (out,) = decode.generate([request(rid, ids, salt=rid)])
    assert out["error"] is None and len(out["token_ids"]) == MAX_TOKENS
    return out["token_ids"]


def run_pd(
    engines: tuple[EngineProc, EngineProc],
    p_ids: list[int],
    d_ids: list[int],
    mode: str,
    order: str = "together",
    d_salt: str | None = None,
    expect_transfer: bool = True,
    **params: Any,
) -> tuple[dict, dict]:
    """One request through P (max_tokens=1) and D with one transfer; returns (P, D) results.
    D's connector must report the KV landed (``expect_transfer``) or, when not, that D
    computed the prompt itself."""
    prefill, decode = engines
    tid = f"tx-{uuid.uuid4().hex[:16]}"
    kv = kv_params(tid, mode, **params)
    p_req = request(f"p-{tid}", p_ids, max_tokens=1, kv=kv)
    d_req = request(f"d-{tid}", d_ids, kv=kv, salt=d_salt)
    if order == "prefill-first":  # P done and holding its blocks before D hears of the request
        (p_out,) = prefill.generate([p_req])
        (d_out,) = decode.generate([d_req])
    elif order == "announcement-first":  # D announced and waits before P starts computing
        decode.submit([d_req])
        time.sleep(0.3)
        (p_out,) = prefill.generate([p_req])
        (d_out,) = decode.collect([d_req["request_id"]])
    else:  # both legs at once, as the gateway publishes them
        prefill.submit([p_req])
        decode.submit([d_req])
        (d_out,) = decode.collect([d_req["request_id"]])
        (p_out,) = prefill.collect([p_req["request_id"]])
    assert p_out["error"] is None, p_out
    assert d_out["error"] is None, d_out
    assert (d_out["kv_landed_ns"] > 0) is expect_transfer, d_out
    return p_out, d_out


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    "length",
    [1, 50, BLOCK, 3 * BLOCK, 2 * BLOCK + 77],
    ids=["1-token", "under-1-block", "1-block", "3-blocks", "not-multiple"],
)
def test_pd_output_equals_one_engine_for_every_prompt_shape(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random, mode: str, length: int
) -> None:
    ids = prompt(rng, length)
    expected = reference(pd_engines[1], ids)
    # a 1-token prompt has nothing to move (D computes its one token: min_transfer_tokens)
    _, d_out = run_pd(pd_engines, ids, ids, mode, expect_transfer=length > 1)
    assert d_out["token_ids"] == expected


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("order", ["together", "prefill-first", "announcement-first"])
def test_swap_decode_answers_from_the_moved_kv_in_either_order(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random, mode: str, order: str
) -> None:
    """docs/design.md, correctness rule 8: P prefills A; D is told B (same length, same last
    token: D recomputes the last prompt token itself) with A's transfer; D must answer as if it
    had seen A."""
    a = prompt(rng, 2 * BLOCK + 40)
    b = [*prompt(rng, len(a) - 1), a[-1]]
    expected_a, expected_b = reference(pd_engines[1], a), reference(pd_engines[1], b)
    assert expected_a != expected_b  # otherwise the swap proves nothing
    _, d_out = run_pd(pd_engines, a, b, mode, order, d_salt=f"swap-{uuid.uuid4().hex}")
    assert d_out["token_ids"] == expected_a


def test_partial_prefix_hit_on_decode_pushes_only_the_missing_blocks(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random, nats_server: EmbeddedNats
) -> None:
    decode = pd_engines[1]
    shared = prompt(rng, 2 * BLOCK)
    warm = shared + prompt(rng, 60)
    ids = shared + prompt(rng, BLOCK + 30)  # 4 blocks; D holds the first 2
    (warm_out,) = decode.generate([request("warm-" + uuid.uuid4().hex[:8], warm)])
    assert warm_out["error"] is None
    expected = reference(decode, ids)

    pushed: list[KvPushed] = []
    done = threading.Event()

    async def listen() -> None:
        bus = await Bus.connect(BusConfig(url=nats_server.url, name="observer"))

        async def on_done(subject: str, message: Any) -> None:
            if isinstance(message, KvPushed):  # not the KvPushing hint
                pushed.append(message)
                done.set()

        await bus.subscribe(subjects.kv_done(DECODE_ID), on_done)
        await bus.flush()
        listening.set()
        while not done.is_set():
            await asyncio.sleep(0.02)
        await bus.close()

    listening = threading.Event()
    observer = threading.Thread(target=lambda: asyncio.run(listen()), daemon=True)
    observer.start()
    assert listening.wait(10)
    _, d_out = run_pd(pd_engines, ids, ids, "push")
    observer.join(10)
    assert d_out["token_ids"] == expected
    assert d_out["num_cached_tokens"] >= 2 * BLOCK
    assert len(pushed) == 1
    (event,) = pushed
    assert event.num_tokens == len(ids)
    # K and V of one 128-token block of one layer (fp32): two blocks (tokens 256..413) of each
    # layer were pushed, not four
    tiny, fp32 = models.TINY, 4
    block_bytes = BLOCK * tiny.kv_heads * tiny.head_dim * 2 * fp32
    assert event.bytes == 2 * tiny.layers * block_bytes, event
    assert event.descriptors == tiny.layers  # one coalesced run per layer


def test_many_concurrent_transfers_are_all_token_exact(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    prefill, decode = pd_engines
    prompts = [prompt(rng, rng.randrange(140, 420)) for _ in range(8)]
    expected = [reference(decode, ids) for ids in prompts]
    p_reqs, d_reqs = [], []
    for i, ids in enumerate(prompts):
        tid = f"tx-many-{uuid.uuid4().hex[:10]}"
        kv = kv_params(tid, "push" if i % 2 == 0 else "pull")
        p_reqs.append(request(f"p-{tid}", ids, max_tokens=1, kv=kv))
        d_reqs.append(request(f"d-{tid}", ids, kv=kv, salt=f"many-{tid}"))
    prefill.submit(p_reqs)
    decode.submit(d_reqs)
    d_outs = decode.collect([r["request_id"] for r in d_reqs])
    prefill.collect([r["request_id"] for r in p_reqs])
    assert [out["token_ids"] for out in d_outs] == expected
    assert all(out["kv_landed_ns"] > 0 for out in d_outs), d_outs


def test_long_prompts_decode_computes_take_a_step_each(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    """Prompts D computes itself that lack ``serial_prefill_tokens`` (512) or more tokens in its
    prefix cache are admitted one an engine step (``SchedulerHalf._waits_its_turn``); a short
    one joins the step. vLLM's own batching would take all three in one step (this test then
    fails: one busy step, not two)."""
    decode = pd_engines[1]
    burst = [prompt(rng, 4 * BLOCK + 100), prompt(rng, 50), prompt(rng, 4 * BLOCK + 100)]
    expected = [reference(decode, ids) for ids in burst]
    before = decode.stats()
    outs = decode.generate(
        [request(f"turns-{uuid.uuid4().hex[:8]}", ids, max_tokens=1) for ids in burst]
    )
    after = decode.stats()
    assert all(out["error"] is None for out in outs), outs
    assert [out["token_ids"] for out in outs] == [ids[:1] for ids in expected]
    busy = (after["steps"] - after["idle_steps"]) - (before["steps"] - before["idle_steps"])
    assert busy == 2, (before, after)
