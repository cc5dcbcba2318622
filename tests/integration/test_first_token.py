"""P's first token: D continues the answer from the token P's prefill sampled.

Two real vLLM CPU engines with the kvpush connector (the session's pair), real NIXL and a real
nats-server. The test plays the worker services' part: it submits the prompt to P with the
prefill's sampling (one token, ``first_token.prefill_sampling``), sends P's token to D as the
prefill worker does (``FirstToken`` from ``first_token.first_token_of``, on the bus), and reads
D's answer. Every answer is compared with D computing the prompt alone, and both engines end
every test with every block free (``no_leaked_blocks``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import msgspec
import pytest

from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas import SamplingSpec, subjects
from kvpush.services.natsd import EmbeddedNats
from kvpush.services.workers.first_token import first_token_of, prefill_sampling
from kvpush.services.workers.handles import EngineOutput
from tests.integration.conftest import DECODE_ID, PREFILL_ID
from tests.integration.engine_proc import EngineProc
from tests.integration.test_connector_vllm import BLOCK, MAX_TOKENS, kv_params, prompt

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("no_leaked_blocks")]

WAIT_S = 2.0  # ConnectorSettings.first_token_wait_s: D's engines run with the default


def sampling(max_tokens: int = MAX_TOKENS, **extra: Any) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, **extra)


def alone(decode: EngineProc, ids: list[int], spec: SamplingSpec) -> dict[str, Any]:
    """D computing ``ids`` itself (its prefix cache kept apart by a unique salt)."""
    rid = f"ref-{uuid.uuid4().hex[:12]}"
    request = {"request_id": rid, "prompt_token_ids": ids, "cache_salt": rid}
    (out,) = decode.generate([{**request, "sampling": msgspec.to_builtins(spec)}])
    assert out["error"] is None, out
    return out


def send(nats_url: str, message: Any) -> None:
    """Publish one message on D's kv.done subject, as the prefill worker does."""

    async def publish() -> None:
        # a 2-core box whose engine-core processes spin while D waits for KV (pull) kept one
        # clean-clone run's connect past the default 15 s: this one waits as long as it takes
        config = BusConfig(
            url=nats_url,
            name="test-prefill-service",
            connect_timeout_s=60.0,
            initial_connect_timeout_s=300.0,
        )
        bus = await Bus.connect(config)
        try:
            await bus.publish(subjects.kv_done(message.decode_id), message)
            await bus.flush()
        finally:
            await bus.close()

    asyncio.run(publish())


def run(
    engines: tuple[EngineProc, EngineProc],
    nats_url: str | None,
    p_ids: list[int],
    d_ids: list[int],
    mode: str,
    spec: SamplingSpec,
    ids: tuple[str, str] = (PREFILL_ID, DECODE_ID),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """P prefills ``p_ids`` sampling the first token, D is handed ``d_ids`` with the same
    transfer; P's token goes to D over the bus (``nats_url`` None: it never does). ``ids``:
    the engines' worker ids (P, D)."""
    prefill, decode = engines
    tid = f"tx-{uuid.uuid4().hex[:16]}"
    kv = kv_params(tid, mode, first_token_from_prefill=True)
    kv["kvpush"].update(prefill_id=ids[0], decode_id=ids[1])
    p_req = {"request_id": f"p-{tid}", "prompt_token_ids": p_ids, "kv_transfer_params": kv}
    p_req["sampling"] = msgspec.to_builtins(prefill_sampling(spec))
    d_req = {"request_id": f"d-{tid}", "prompt_token_ids": d_ids, "kv_transfer_params": kv}
    d_req.update(sampling=msgspec.to_builtins(spec), cache_salt=f"ft-{tid}")
    prefill.submit([p_req])
    decode.submit([d_req])
    (p_out,) = prefill.collect([p_req["request_id"]])
    assert p_out["error"] is None and len(p_out["token_ids"]) == 1, p_out
    if nats_url is not None:
        final = EngineOutput(
            p_out["request_id"],
            p_out["token_ids"],
            p_out["text"],
            p_out["finish_reason"],
            stop_reason=p_out["stop_reason"],
        )
        send(nats_url, first_token_of(tid, *ids, final))
    (d_out,) = decode.collect([d_req["request_id"]])
    assert d_out["error"] is None, d_out
    assert d_out["kv_landed_ns"] > 0, d_out  # D had the moved KV
    # D continued from P's token (not: waited it out and sampled the token itself)
    assert (d_out["prefill_token_ns"] > 0) is (nats_url is not None), d_out
    return p_out, d_out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_continues_from_the_token_prefill_sampled(
    pd_engines: tuple[EngineProc, EngineProc],
    nats_server: EmbeddedNats,
    rng: random.Random,
    mode: str,
) -> None:
    """P prefills A; D is handed B (another prompt of A's length, another last token too) with
    A's transfer. D answers A's answer token for token only if every prompt position's KV came
    from P (A's last token included: D computes no prompt token) and its first token is P's.
    Sampling the first token itself, D would recompute its prompt's last token (B's) over A's
    other positions and answer ``own_first``; computing the prompt (B) and going on from P's
    token, it would answer ``silent``."""
    swap(pd_engines, nats_server.url, rng, mode)


def swap(
    engines: tuple[EngineProc, EngineProc],
    nats_url: str,
    rng: random.Random,
    mode: str,
    ids: tuple[str, str] = (PREFILL_ID, DECODE_ID),
) -> None:
    """The swap of ``test_decode_continues_from_the_token_prefill_sampled``."""
    decode = engines[1]
    for _ in range(5):  # a pair of prompts the swap tells apart (the tiny model may not)
        a = prompt(rng, 2 * BLOCK + 40)
        b = prompt(rng, len(a))
        b[-1] = (a[-1] + 7) % 1990 + 10
        expected = alone(decode, a, sampling())["token_ids"]
        own_first = alone(decode, [*a[:-1], b[-1]], sampling())["token_ids"]
        silent = alone(decode, [*b, expected[0]], sampling(MAX_TOKENS - 1))["token_ids"]
        if expected != own_first and expected[1:] != silent:
            break
    else:
        pytest.fail("no prompt pair of five tells the swap apart")
    p_out, d_out = run(engines, nats_url, a, b, mode, sampling(), ids)
    assert d_out["token_ids"] == expected
    assert d_out["token_ids"][0] == p_out["token_ids"][0]
    assert d_out["finish_reason"] == "length"


def test_text_and_stop_strings_read_as_one_engine_s(
    pd_engines: tuple[EngineProc, EngineProc], nats_server: EmbeddedNats, rng: random.Random
) -> None:
    """D's detokenizer sees P's token in its context: the whole text equals one engine's, and
    a stop string that starts in the first token and ends later is found."""
    decode = pd_engines[1]
    ids = prompt(rng, BLOCK + 60)
    plain = alone(decode, ids, sampling())
    _, d_out = run(pd_engines, nats_server.url, ids, ids, "push", sampling())
    assert (d_out["token_ids"], d_out["text"]) == (plain["token_ids"], plain["text"])
    first = alone(decode, ids, sampling(1))["text"]
    stop = first[-1:] + plain["text"][len(first) : len(first) + 2]  # across tokens 1 and 2
    assert len(stop) == 3 and plain["text"].startswith(first), (first, plain)
    spec = sampling(stop=[stop])
    expected = alone(decode, ids, spec)
    _, d_out = run(pd_engines, nats_server.url, ids, ids, "push", spec)
    assert expected["finish_reason"] == "stop", expected
    keys = ("token_ids", "text", "finish_reason", "stop_reason")
    assert {k: d_out[k] for k in keys} == {k: expected[k] for k in keys}, (d_out, expected)


@pytest.mark.parametrize("ends", ["max_tokens", "stop_token", "stop_string"])
def test_a_first_token_that_ends_the_answer_ends_it_on_decode(
    pd_engines: tuple[EngineProc, EngineProc],
    nats_server: EmbeddedNats,
    rng: random.Random,
    ends: str,
) -> None:
    """One token asked for, or P's token is a stop token or holds a stop string: D answers
    with that token alone and ends the request without a step of its own (its blocks come back:
    ``no_leaked_blocks``), exactly as one engine would."""
    decode = pd_engines[1]
    ids = prompt(rng, 2 * BLOCK + 5)
    first = alone(decode, ids, sampling(1))
    assert first["text"], first  # the stop string below is the first token's text
    spec = {
        "max_tokens": sampling(1),
        "stop_token": sampling(stop_token_ids=first["token_ids"]),
        "stop_string": sampling(stop=[first["text"]]),
    }[ends]
    expected = alone(decode, ids, spec)
    assert len(expected["token_ids"]) == 1, expected
    _, d_out = run(pd_engines, nats_server.url, ids, ids, "push", spec)
    keys = ("token_ids", "text", "finish_reason", "stop_reason")
    assert {k: d_out[k] for k in keys} == {k: expected[k] for k in keys}


def test_without_the_prefill_token_decode_samples_it_after_the_wait(
    pd_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    """An older prefill worker never sends FirstToken: D waits ``first_token_wait_s`` after the
    KV landed, then samples the first token itself; the answer is still one engine's."""
    decode = pd_engines[1]
    ids = prompt(rng, BLOCK + 10)
    expected = alone(decode, ids, sampling())["token_ids"]
    started = time.monotonic()
    _, d_out = run(pd_engines, None, ids, ids, "push", sampling())
    assert d_out["token_ids"] == expected
    assert time.monotonic() - started >= WAIT_S  # it did wait (a lower bound: never flaky)
