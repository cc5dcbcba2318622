"""The prefill and decode workers as deployed (``kvpush prefill|decode`` processes), driven over
the bus exactly as the gateway drives them: one RequestEvent on ``req.<P>.<D>``, TokenChunks back.

Three workers start once for the module: P (``wp0``, core 0), D (``wd0``, core 1) and a second
decode worker ``wd1`` (core 0, ``--max-inflight 2``) whose engine shares no prefix cache with
``wd0``: it computes every reference answer alone (mode local), so a P/D answer is compared
with an engine that never saw the moved KV. The last test drains ``wd1`` with SIGTERM.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush.schemas import subjects
from kvpush.schemas.messages import Abort, FinishReason, KvFailed, TokenChunk, WorkerRole
from kvpush.schemas.sampling import TokenLogprob
from kvpush.services.natsd import EmbeddedNats
from kvpush.services.workers.registry import Registry
from tests.integration.worker_proc import Observer, WorkerProc, kill_all, text_of, tokens_of

pytestmark = pytest.mark.engine

P, D, REF = "wp0", "wd0", "wd1"
MAX_TOKENS = 8
CONTEXT = 4096


@dataclass
class Workers:
    observer: Observer
    procs: dict[str, WorkerProc]


# REF's drain test checks its request finishes, however busy the box: a long drain timeout
REF_FLAGS = ("--max-inflight", "2", "--drain-timeout-s", "600")


@pytest.fixture(scope="module")
async def workers(
    tiny_model: Path, nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Workers]:
    logs = tmp_path_factory.mktemp("worker-logs")
    url = nats_server.url
    procs = {
        P: WorkerProc("prefill", P, url, tiny_model, [0], logs),
        D: WorkerProc("decode", D, url, tiny_model, [1], logs),
        REF: WorkerProc("decode", REF, url, tiny_model, [0], logs, *REF_FLAGS),
    }
    observer = await Observer.connect(url)
    try:
        for proc in procs.values():
            proc.start()
        await observer.wait_ready(list(procs.values()))
        yield Workers(observer, procs)
        for proc in procs.values():
            assert proc.stop() == 0, proc.tail()
    finally:
        kill_all(list(procs.values()))
        await observer.close()


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10, 2000) for _ in range(length)]


def assert_well_formed(chunks: list[TokenChunk], finish: FinishReason, prompt_len: int) -> None:
    """seq 0..n-1; only the last chunk ends the stream and carries usage."""
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    *body, last = chunks
    assert all(c.finish_reason is None and c.usage is None and c.error is None for c in body)
    assert last.finish_reason is finish and last.error is None
    assert last.usage is not None
    answers = sum(len(tokens) for tokens in answers_of(chunks).values())
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        prompt_len,
        len(tokens_of(chunks)) + answers,
    )


def answers_of(chunks: list[TokenChunk]) -> dict[int, list[int]]:
    """Each answer's tokens, by index, from the chunks' ``outputs`` (n > 1 or logprobs)."""
    answers: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks:
        for seq in chunk.outputs or []:
            answers[seq.index].extend(seq.token_ids)
    return dict(answers)


def logprobs_of(chunks: list[TokenChunk], index: int = 0) -> list[list[TokenLogprob]]:
    return [
        pos
        for chunk in chunks
        for seq in chunk.outputs or []
        if seq.index == index
        for pos in seq.logprobs or []
    ]


async def blocks_back(obs: Observer, *worker_ids: str) -> None:
    """Every block of each worker free again (a fresh heartbeat says so), nothing in flight."""
    for worker in worker_ids:
        await obs.fresh_beat(worker, lambda b: b.in_flight == 0 and b.free_blocks == b.total_blocks)


def kv_landed(chunks: list[TokenChunk]) -> int:
    """When D had the moved KV (its last chunk's Timing); 0: D computed the prompt itself."""
    timing = chunks[-1].timing
    return timing.kv_landed if timing is not None else 0


def prefill_token(chunks: list[TokenChunk]) -> int:
    """When D took up P's first token (its last chunk's Timing); 0: D sampled it itself."""
    timing = chunks[-1].timing
    return timing.prefill_token if timing is not None else 0


async def reference(
    obs: Observer, ids: list[int], max_tokens: int = MAX_TOKENS
) -> list[TokenChunk]:
    """``wd1`` computing the prompt alone (its prefix cache never held this prompt's KV)."""
    chunks = await obs.generate(obs.event(P, REF, ids, "local", max_tokens))
    assert_well_formed(chunks, FinishReason.LENGTH, len(ids))
    assert len(tokens_of(chunks)) == max_tokens
    assert kv_landed(chunks) == 0  # mode local: nothing moved (the signal tells them apart)
    return chunks


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("length", [50, 300], ids=["under-1-block", "3-blocks"])
@pytest.mark.parametrize("first_token_by", ["prefill", "decode"])
async def test_decode_streams_what_one_engine_computes_after_the_kv_moved(
    workers: Workers, rng: random.Random, mode: str, length: int, first_token_by: str
) -> None:
    obs = workers.observer
    ids = prompt(rng, length)
    event = obs.event(P, D, ids, mode, MAX_TOKENS, first_token_by=first_token_by)
    chunks = await obs.generate(event)
    assert_well_formed(chunks, FinishReason.LENGTH, length)
    assert kv_landed(chunks) > 0, chunks[-1]  # a silent recompute on D fails here
    assert (prefill_token(chunks) > 0) is (first_token_by == "prefill"), chunks[-1]
    expected = await reference(obs, ids)
    assert tokens_of(chunks) == tokens_of(expected)
    assert text_of(chunks) == text_of(expected) != ""


async def test_a_non_streaming_request_gets_every_token_in_chunks_as_they_come(
    workers: Workers, rng: random.Random
) -> None:
    """D streams whatever the client's ``stream`` (the gateway joins them): an answer has no
    total deadline, only an idle one between chunks, so the gateway must see progress."""
    obs = workers.observer
    ids = prompt(rng, 200)
    chunks = await obs.generate(obs.event(P, D, ids, "push", 12, stream=False))
    assert_well_formed(chunks, FinishReason.LENGTH, len(ids))
    assert len(chunks) > 1 and kv_landed(chunks) > 0, chunks[-1]
    assert tokens_of(chunks) == tokens_of(await reference(obs, ids, 12))


@pytest.mark.parametrize("ends", ["max_tokens", "stop_token"])
async def test_an_answer_that_ends_with_the_prefill_s_first_token(
    workers: Workers, rng: random.Random, ends: str
) -> None:
    """P's first token is the whole answer (one token asked for; a stop token): D sends it as
    one engine would, without a step of its own, and both workers get every block back."""
    obs = workers.observer
    ids = prompt(rng, 300)
    first = tokens_of(await reference(obs, ids))[0]
    limits = {"max_tokens": (1, {}), "stop_token": (MAX_TOKENS, {"stop_token_ids": [first]})}
    max_tokens, extra = limits[ends]
    chunks = await obs.generate(obs.event(P, D, ids, "push", max_tokens, **extra))
    expected = await obs.generate(obs.event(P, REF, ids, "local", max_tokens, **extra))
    assert kv_landed(chunks) > 0 and prefill_token(chunks) > 0, chunks[-1]
    assert tokens_of(chunks) == tokens_of(expected) == [first]
    assert text_of(chunks) == text_of(expected)
    assert chunks[-1].finish_reason is expected[-1].finish_reason
    for worker in (P, D):
        await obs.fresh_beat(worker, lambda b: b.in_flight == 0 and b.free_blocks == b.total_blocks)


async def test_a_full_decode_worker_answers_overloaded_at_once_and_an_abort_frees_it(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    long = [obs.event(P, REF, prompt(rng, 40), "local", 3000, ignore_eos=True) for _ in range(2)]
    for event in long:
        await obs.publish(event)
    await obs.wait_for(lambda: all(obs.chunks.get(e.request_id) for e in long), 30, "2 running")
    (refused,) = await obs.generate(obs.event(P, REF, prompt(rng, 40), "local"), timeout_s=30)
    # at once: refused while both slots are still busy, not queued until one frees
    assert not any(obs.finished(e.request_id) for e in long)
    assert (refused.seq, refused.error, refused.finish_reason) == (
        0,
        "overloaded",
        FinishReason.ERROR,
    )
    for event in long:
        abort = Abort(transfer_id=event.transfer_id, sender=obs.gateway_id, reason="test")
        await obs.bus.publish(subjects.abort(REF), abort)
    for event in long:
        chunks = await obs.collect(event, 15)
        assert chunks[-1].finish_reason is FinishReason.ABORT
        assert 0 < len(tokens_of(chunks)) < 3000
    served = await obs.generate(obs.event(P, REF, prompt(rng, 40), "local"))
    assert_well_formed(served, FinishReason.LENGTH, 40)


async def test_an_aborted_transfer_frees_every_block_on_both_workers(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    ids = prompt(rng, 700)
    event = obs.event(P, D, ids, "push", CONTEXT - len(ids) - 8, ignore_eos=True)
    await obs.publish(event)
    await obs.wait_for(lambda: len(obs.chunks[event.request_id]) >= 2, 30, "tokens flowing")
    busy = await obs.fresh_beat(D, lambda b: b.in_flight == 1)
    assert busy.free_blocks < busy.total_blocks  # the request holds blocks: the check can fail
    for worker in (P, D):
        abort = Abort(transfer_id=event.transfer_id, sender=obs.gateway_id, reason="client gone")
        await obs.bus.publish(subjects.abort(worker), abort)
    chunks = await obs.collect(event, 15)
    assert chunks[-1].finish_reason is FinishReason.ABORT
    for worker in (P, D):
        await obs.fresh_beat(worker, lambda b: b.in_flight == 0 and b.free_blocks == b.total_blocks)


async def test_a_late_request_is_refused_at_once_and_a_running_one_outlives_its_deadline(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    failed: list[KvFailed] = []

    async def on_failed(subject: str, message: object) -> None:
        if isinstance(message, KvFailed):
            failed.append(message)

    sub = await obs.bus.subscribe(subjects.kv_failed(D), on_failed)
    late = obs.event(P, D, prompt(rng, 300), "push", deadline_s=-1.0)
    (chunk,) = await obs.generate(late, timeout_s=5)
    assert (chunk.error, chunk.finish_reason) == ("deadline", FinishReason.ERROR)
    await obs.wait_for(lambda: bool(failed), 5, "KvFailed from prefill")
    assert failed[0].transfer_id == late.transfer_id and failed[0].reason.value == "deadline"
    await sub.unsubscribe()

    # a deadline is the first output's: a request that runs past it is not cut (no total one)
    started = time.monotonic()
    running = obs.event(P, REF, prompt(rng, 40), "local", 300, ignore_eos=True, deadline_s=0.3)
    chunks = await obs.generate(running, timeout_s=60)
    assert (chunks[-1].finish_reason, chunks[-1].error) == (FinishReason.LENGTH, None)
    assert len(tokens_of(chunks)) == 300
    assert time.monotonic() - started > 0.3  # it did outlive its deadline


async def test_a_request_for_another_model_is_refused(workers: Workers, rng: random.Random) -> None:
    obs = workers.observer
    event = obs.event(P, D, prompt(rng, 30), "push", model="some-other-model")
    (chunk,) = await obs.generate(event, timeout_s=5)
    assert chunk.finish_reason is FinishReason.ERROR
    assert chunk.error is not None and "some-other-model" in chunk.error


async def test_workers_beat_every_second_and_keep_a_registry_entry(workers: Workers) -> None:
    obs = workers.observer
    seen = len(obs.beats[D])
    await obs.wait_for(lambda: len(obs.beats[D]) >= seen + 3, 6, "3 heartbeats")
    a, _b, c = obs.beats[D][-3:]
    assert 0.5 < (c.sent_at_ms - a.sent_at_ms) / 2000 < 1.5
    assert a.epoch == c.epoch and a.role is WorkerRole.DECODE and a.model == "kvpush-tiny"
    assert a.side_channel.startswith("tcp://") and a.total_blocks > 0 and not a.draining
    registry = await Registry.open(obs.bus, 5.0)
    assert registry is not None
    entries = {beat.worker_id: beat for beat in await registry.entries()}
    assert {P, D, REF} <= set(entries)
    assert entries[P].side_channel == obs.last_beat(P).side_channel
    assert entries[P].role is WorkerRole.PREFILL
    # D sends P's side channel with every transfer (the connector probes it if P goes quiet)
    log = workers.procs[D].log_path.read_text()
    assert f"prefill {P} ({entries[P].side_channel})" in log


# ---- OpenAI parity: n answers, log-probabilities, penalties --------------------------------
async def test_n_seeded_answers_after_a_push_are_each_what_one_engine_draws_alone(
    workers: Workers, rng: random.Random
) -> None:
    """n = 3 fans out on D: answer 0 takes the pushed KV, answers 1 and 2 start after its first
    output; answer i draws as one engine does with seed 7 + i (vLLM's ParentRequest rule)."""
    obs = workers.observer
    ids = prompt(rng, 300)
    seeded: dict[str, Any] = {"temperature": 1.0, "seed": 7}
    chunks = await obs.generate(obs.event(P, D, ids, "push", MAX_TOKENS, n=3, **seeded))
    assert_well_formed(chunks, FinishReason.LENGTH, len(ids))
    assert kv_landed(chunks) > 0 and prefill_token(chunks) == 0, chunks[-1]  # seeded: D samples
    assert all(c.token_ids == [] and c.text == "" for c in chunks)  # the answers are in outputs
    answers = answers_of(chunks)
    assert sorted(answers) == [0, 1, 2]
    ends = {s.index: s.finish_reason for c in chunks for s in c.outputs or [] if s.finish_reason}
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].num_cached_tokens is not None
    for i in range(3):
        alone = obs.event(P, REF, ids, "local", MAX_TOKENS, temperature=1.0, seed=7 + i)
        expected = tokens_of(await obs.generate(alone))
        assert answers[i] == expected, i
    assert len({tuple(tokens) for tokens in answers.values()}) > 1  # the seeds differ
    await blocks_back(obs, P, D)


async def test_logprobs_after_a_push_are_one_engine_s(workers: Workers, rng: random.Random) -> None:
    obs = workers.observer
    ids = prompt(rng, 300)
    chunks = await obs.generate(obs.event(P, D, ids, "push", MAX_TOKENS, logprobs=3))
    expected = await obs.generate(obs.event(P, REF, ids, "local", MAX_TOKENS, logprobs=3))
    for got in (chunks, expected):
        assert_well_formed(got, FinishReason.LENGTH, len(ids))
    assert kv_landed(chunks) > 0 and prefill_token(chunks) == 0, chunks[-1]
    assert answers_of(chunks)[0] == answers_of(expected)[0]
    assert len(answers_of(chunks)[0]) == MAX_TOKENS
    got, want = logprobs_of(chunks), logprobs_of(expected)
    assert len(got) == len(want) == MAX_TOKENS
    for token, pos, ref in zip(answers_of(chunks)[0], got, want, strict=True):
        assert pos[0].token_id == token  # the sampled token first, then the top 3
        assert [c.token_id for c in pos] == [c.token_id for c in ref]
        assert 3 <= len(pos) <= 4
        for c, r in zip(pos, ref, strict=True):
            assert abs(c.logprob - r.logprob) <= 1e-4, (c, r)
            assert c.rank is not None and c.rank >= 1 and c.decoded
            assert c.logprob >= -9999.0
    assert {pos[0].rank for pos in got} == {1}  # greedy: the sampled token is the top one
    cumulative = [s.cumulative_logprob for c in chunks for s in c.outputs or []]
    assert cumulative[-1] == pytest.approx(sum(pos[0].logprob for pos in got), abs=1e-3)


@pytest.mark.parametrize(
    ("penalties", "prefill_samples"),
    [
        ({"presence_penalty": 0.8, "frequency_penalty": 0.6, "min_p": 0.05}, False),
        ({"repetition_penalty": 1.5, "min_p": 0.05, "logit_bias": {42: 4.0, 77: -100.0}}, True),
    ],
    ids=["history", "per-step"],
)
async def test_penalties_min_p_and_logit_bias_after_a_push_are_one_engine_s(
    workers: Workers, rng: random.Random, penalties: dict[str, Any], prefill_samples: bool
) -> None:
    """Penalties on the answer's history mean D samples the first token (P's token would be a
    prompt token to D); per-step ones leave it to P. Either way the answer is one engine's."""
    obs = workers.observer
    ids = prompt(rng, 300)
    max_tokens = 16
    sampling = {"repetition_penalty": 1.3, **penalties}
    chunks = await obs.generate(obs.event(P, D, ids, "push", max_tokens, **sampling))
    expected = await obs.generate(obs.event(P, REF, ids, "local", max_tokens, **sampling))
    plain = await obs.generate(obs.event(P, REF, ids, "local", max_tokens))
    assert_well_formed(chunks, FinishReason.LENGTH, len(ids))
    assert kv_landed(chunks) > 0 and (prefill_token(chunks) > 0) is prefill_samples, chunks[-1]
    assert tokens_of(chunks) == tokens_of(expected)
    assert text_of(chunks) == text_of(expected)
    assert tokens_of(chunks) != tokens_of(plain)  # the parameters did something


async def test_prompt_logprobs_come_in_the_first_chunk_and_push_or_pull_is_refused(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    ids = prompt(rng, 150)
    chunks = await obs.generate(obs.event(P, D, ids, "local", 4, prompt_logprobs=2))
    assert_well_formed(chunks, FinishReason.LENGTH, len(ids))
    first, *rest = chunks
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids)
    assert first.prompt_logprobs[0] is None
    for token, pos in zip(ids[1:], first.prompt_logprobs[1:], strict=True):
        assert pos is not None and pos[0].token_id == token and 2 <= len(pos) <= 3
        assert all(c.logprob >= -9999.0 and c.rank is not None for c in pos)
    assert all(c.prompt_logprobs is None for c in rest)
    assert len(answers_of(chunks)[0]) == 4
    for mode in ("push", "pull"):
        event = obs.event(P, D, ids, mode, 4, prompt_logprobs=2)
        (refused,) = await obs.generate(event, timeout_s=10)
        assert refused.finish_reason is FinishReason.ERROR
        assert refused.error is not None and "prompt_logprobs" in refused.error
        assert "local" in refused.error
    await blocks_back(obs, P, D)


async def test_an_aborted_request_of_n_answers_frees_every_answer_s_blocks(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    ids = prompt(rng, 300)
    max_tokens = CONTEXT - len(ids) - 8
    event = obs.event(P, D, ids, "push", max_tokens, n=3, temperature=1.0, ignore_eos=True)
    await obs.publish(event)

    def every_answer_runs() -> bool:
        return set(answers_of(obs.chunks[event.request_id])) == {0, 1, 2}

    await obs.wait_for(every_answer_runs, 60, "3 answers flowing")
    busy = await obs.fresh_beat(D, lambda b: b.in_flight == 1)
    assert busy.free_blocks < busy.total_blocks - 3  # 2 shared prompt blocks, 1+ per answer
    for worker in (P, D):
        abort = Abort(transfer_id=event.transfer_id, sender=obs.gateway_id, reason="client gone")
        await obs.bus.publish(subjects.abort(worker), abort)
    chunks = await obs.collect(event, 15)
    assert chunks[-1].finish_reason is FinishReason.ABORT
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert all(len(t) < max_tokens for t in answers_of(chunks).values())
    await blocks_back(obs, P, D)


async def test_sigterm_drains_a_worker_in_flight_requests_finish_new_ones_do_not_arrive(
    workers: Workers, rng: random.Random
) -> None:
    obs = workers.observer
    proc = workers.procs[REF]
    # long enough to outlast the drain's grace on an idle box (ms per token), short enough to
    # end well inside the drain timeout on a busy one (a 3000-token answer took 300 s in a
    # clean-clone suite: 100 ms per token)
    running = obs.event(P, REF, prompt(rng, 40), "local", 1000, ignore_eos=True)
    await obs.publish(running)
    await obs.wait_for(lambda: bool(obs.chunks.get(running.request_id)), 30, "first token")
    proc.signal(signal.SIGTERM)
    await obs.fresh_beat(REF, lambda b: b.draining, timeout_s=5)
    await asyncio.sleep(1.0)  # past the drain grace: the request subject is gone
    assert not obs.finished(running.request_id), "too short to observe the drain"
    refused = obs.event(P, REF, prompt(rng, 40), "local")
    await obs.publish(refused)
    chunks = await obs.collect(running, 600)  # a correctness check: however busy the box
    assert_well_formed(chunks, FinishReason.LENGTH, 40)
    assert len(tokens_of(chunks)) == 1000
    assert await asyncio.to_thread(proc.proc.wait, 30) == 0, proc.tail()
    assert refused.request_id not in obs.chunks
    registry = await Registry.open(obs.bus, 5.0)
    assert registry is not None
    assert REF not in {beat.worker_id for beat in await registry.entries(WorkerRole.DECODE)}
    assert "drained" in proc.log_path.read_text()
