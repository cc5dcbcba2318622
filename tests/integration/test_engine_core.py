"""Engines as ``vllm serve`` runs them: ``CoreEngineHost`` (vLLM's ``AsyncLLM``, the engine core
in a process of its own, kvpush's scheduler and worker extension in it) with the kvpush
connector, on CPU.

A prefill and a decode engine of that kind (this module's pair, pinned like the session's, own
worker ids) move KV over real NIXL with a real nats-server. The swap tests prove the KV moved
(D is told another prompt than P computed, and answers P's), that D continued from the token
P sampled (kvpush's scheduler reported it from the engine-core process), that the driver reads
the KV integrity counts of D's engine-core process (``CoreLink``), and every test ends with
both pools back to where they started (vLLM's scheduler stats, read by the host).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvpush.schemas import SamplingSpec
from kvpush.services.natsd import EmbeddedNats
from tests.integration.conftest import start_pair, wait_for
from tests.integration.engine_proc import D_CORES, P_CORES, EngineProc
from tests.integration.test_connector_vllm import BLOCK, prompt, reference, run_pd
from tests.integration.test_first_token import alone, run, sampling, swap

pytestmark = [pytest.mark.engine]
IDS = ("p-core", "d-core")


@pytest.fixture(scope="module")
def core_engines(
    tiny_model: Path, nats_server: EmbeddedNats, engine_logs: Path
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """P (core 0) and D (core 1), each an engine-core process behind AsyncLLM."""
    names = (("P-core", IDS[0], P_CORES), ("D-core", IDS[1], D_CORES))
    engines = start_pair(tiny_model, nats_server.url, engine_logs, names, engine_core="process")
    yield engines
    for engine in engines:
        engine.stop()


@pytest.fixture(autouse=True)
def no_leaked_blocks(core_engines: tuple[EngineProc, EngineProc]) -> Iterator[None]:
    """Both pools end each test with every block free (the engines' last scheduler stats)."""
    yield
    for engine in core_engines:
        wait_for(
            lambda e=engine: e.free_blocks() == e.total_blocks(),
            15.0,
            f"engine {engine.name}: every block free",
        )


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_decode_continues_from_prefill_s_token_across_engine_core_processes(
    core_engines: tuple[EngineProc, EngineProc],
    nats_server: EmbeddedNats,
    rng: random.Random,
    mode: str,
) -> None:
    """The swap of test_first_token: D answers A's answer to B's prompt only if every prompt
    position's KV came from P and its first token is P's, reported by kvpush's scheduler in
    D's engine-core process and read by vLLM's client as the request's first output."""
    swap(core_engines, nats_server.url, rng, mode, IDS)


def test_swap_without_prefill_s_token_answers_from_the_moved_kv(
    core_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    """No FirstToken asked for: D samples the first token itself over the moved KV."""
    a = prompt(rng, 2 * BLOCK + 40)
    b = [*prompt(rng, len(a) - 1), a[-1]]
    expected_a, expected_b = reference(core_engines[1], a), reference(core_engines[1], b)
    assert expected_a != expected_b  # otherwise the swap proves nothing
    kv = {"prefill_id": IDS[0], "decode_id": IDS[1]}
    _, d_out = run_pd(core_engines, a, b, "push", d_salt=f"swap-{rng.random()}", **kv)
    assert d_out["token_ids"] == expected_a


def test_a_first_token_that_is_a_stop_token_ends_the_answer_in_the_engine_core(
    core_engines: tuple[EngineProc, EngineProc], nats_server: EmbeddedNats, rng: random.Random
) -> None:
    """P's token is a stop token: kvpush's scheduler ends the request with it (no step of
    D's own; its blocks come back), exactly as one engine answers."""
    decode = core_engines[1]
    ids = prompt(rng, 2 * BLOCK + 5)
    first = alone(decode, ids, sampling(1))
    spec = sampling(stop_token_ids=first["token_ids"])
    expected = alone(decode, ids, spec)
    _, d_out = run(core_engines, nats_server.url, ids, ids, "push", spec, IDS)
    keys = ("token_ids", "text", "finish_reason", "stop_reason")
    assert {k: d_out[k] for k in keys} == {k: expected[k] for k in keys}


def test_an_answer_a_stop_string_ends_keeps_its_timing_marks(
    core_engines: tuple[EngineProc, EngineProc], nats_server: EmbeddedNats, rng: random.Random
) -> None:
    """A stop string is found by vLLM's client (the detokenizer), which aborts the request in
    the engine core: the answer's end carries no transfer marks, so D's first output brings
    them (``run`` checks that the KV landed and that D took P's token). Without them the
    gateway counted such answers as a fallback (D computed the prompt)."""
    decode = core_engines[1]
    ids = prompt(rng, BLOCK + 60)
    plain = alone(decode, ids, sampling())
    first = alone(decode, ids, sampling(1))["text"]
    stop = first[-1:] + plain["text"][len(first) : len(first) + 2]  # across tokens 1 and 2
    assert len(stop) == 3 and plain["text"].startswith(first), (first, plain)
    spec = sampling(stop=[stop])
    expected = alone(decode, ids, spec)
    _, d_out = run(core_engines, nats_server.url, ids, ids, "push", spec, IDS)
    assert expected["finish_reason"] == "stop" and len(expected["token_ids"]) > 1, expected
    keys = ("token_ids", "text", "finish_reason", "stop_reason")
    assert {k: d_out[k] for k in keys} == {k: expected[k] for k in keys}, (d_out, expected)


def test_n_answers_and_an_abort_end_as_on_the_in_process_engine(
    core_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    """n = 2 fans out after answer 0's first output (both answers end "length"); a request
    aborted mid-answer ends "abort" and frees its blocks."""
    decode = core_engines[1]
    ids = prompt(rng, BLOCK + 3)
    spec = msgspec.to_builtins(SamplingSpec(max_tokens=6, n=2, seed=1, temperature=1.0))
    request = {"request_id": f"n2-{rng.random()}", "prompt_token_ids": ids, "sampling": spec}
    (out,) = decode.generate([request])
    assert out["error"] is None and out["finish_reason"] == "length", out
    long = msgspec.to_builtins(sampling(3000, ignore_eos=True))
    rid = f"ab-{rng.random()}"
    decode.submit([{"request_id": rid, "prompt_token_ids": ids, "sampling": long}])
    assert decode.wait_tokens(rid, 5, 60.0) >= 5
    decode.abort(rid)
    (out,) = decode.collect([rid])
    assert out["finish_reason"] == "abort" and len(out["token_ids"]) < 3000, out


def test_the_driver_reads_the_integrity_counts_of_the_engine_core_process(
    core_engines: tuple[EngineProc, EngineProc], rng: random.Random
) -> None:
    """D's driver asks the engine-core process's ranks for their KV integrity counts
    (``CoreLink.integrity_counts``, what the decode worker's metric reads): after each verified
    receive they equal the counts of the scheduler half that the final output carries, moved
    by one; P reports none."""
    prefill, decode = core_engines
    kv = {"prefill_id": IDS[0], "decode_id": IDS[1]}
    before = decode.integrity_counts()
    for receives in (1, 2):
        ids = prompt(rng, 2 * BLOCK + 9)
        _, d_out = run_pd(core_engines, ids, ids, "push", **kv)
        seen = (d_out["kv_transfer_params"] or {}).get("kvpush_integrity")
        assert seen is not None and seen["outcome"] == "verified", d_out
        counts = decode.integrity_counts()
        assert counts == seen["counts"], (counts, seen)
        assert counts["verified"] == before.get("verified", 0) + receives, (before, counts)
    assert prefill.integrity_counts() == {}
