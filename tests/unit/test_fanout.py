"""A request's ``n`` answers and what its sampling means for the workers, piece by piece: the
engine host's fan-out bookkeeping (``fanout.Answers``), the ``SamplingParams`` of each answer
(``fanout.engine_params``, on real vLLM in a child process: unit tests never import vllm), where
P's first token is one engine's (``samples_on_prefill``) and P's own sampling, and how D puts an
answer's delta in a TokenChunk. That the answers are one engine's is the integration suite's
job (tests/integration/test_workers.py).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.connector.params import samples_on_prefill
from kvpush.schemas.messages import RequestEvent, TransferMode, WorkerRole
from kvpush.schemas.sampling import SamplingSpec, StructuredOutputs, TokenLogprob
from kvpush.services.workers.decode import chunk_fields, wants_outputs
from kvpush.services.workers.fanout import Answers, child_id
from kvpush.services.workers.first_token import prefill_sampling
from kvpush.services.workers.handles import EngineOutput, RequestHandle
from kvpush.services.workers.inflight import InFlight
from kvpush.services.workers.prefill import PREFILL_SAMPLING, PrefillWorker

RID = "tid-abcdefgh"


def answers(n: int) -> Answers:
    later = [(i, f"params-{i}") for i in range(1, n)]
    return Answers(RID, RequestHandle(RID), ([1, 2, 3], None), {RID: 0}, later)


def delta(index: int, tokens: list[int], end: str | None = None, **extra: Any) -> EngineOutput:
    """What ``delta_of`` makes of one answer's output: its end is the answer's."""
    error = "the engine failed this request" if end == "error" else None
    rid = child_id(RID, index)
    return EngineOutput(
        rid, tokens, "t", end, error, index=index, sequence_finish_reason=end, **extra
    )


# ---- the host's fan-out --------------------------------------------------------------------
def test_later_answers_start_after_answer_0_s_first_output_and_the_last_end_ends_the_request() -> (
    None
):
    a = answers(3)
    assert child_id(RID, 0) == RID and child_id(RID, 2) == f"{RID}.2"
    first = a.take(RID, delta(0, [5], num_cached_tokens=0, kv_transfer_params={"k": 1}))
    assert first.finish_reason is None and not a.ended
    added: list[tuple[str, Any]] = []
    assert a.start_later(lambda eid, params: added.append((eid, params))) is None
    assert added == [(f"{RID}.1", "params-1"), (f"{RID}.2", "params-2")]
    assert a.live == {RID: 0, f"{RID}.1": 1, f"{RID}.2": 2} and a.later == []
    # answer 0 ends first: its own end is on its delta, the request goes on
    zero = a.take(RID, delta(0, [6], "stop", num_cached_tokens=96, kv_transfer_params={"k": 2}))
    assert (zero.finish_reason, zero.sequence_finish_reason, zero.error) == (None, "stop", None)
    assert a.take(f"{RID}.1", delta(1, [7], "length", num_cached_tokens=128)).finish_reason is None
    running = a.take(f"{RID}.2", delta(2, [8]))
    assert running.finish_reason is None and running.index == 2
    last = a.take(f"{RID}.2", delta(2, [9], "length", num_cached_tokens=128))
    assert a.ended and (last.finish_reason, last.index, last.token_ids) == ("length", 2, [9])
    assert last.request_id == running.request_id == RID  # the request's, not the engine's id
    # answer 0's cached tokens and transfer parameters (its timing) on the request's end
    assert (last.num_cached_tokens, last.kv_transfer_params) == (96, {"k": 2})


def test_an_answer_that_failed_makes_the_request_s_end_an_error() -> None:
    a = answers(2)
    a.take(RID, delta(0, [5]))
    a.start_later(lambda eid, params: None)
    failed = a.take(f"{RID}.1", delta(1, [], "error"))
    assert (failed.finish_reason, failed.error, failed.sequence_finish_reason) == (
        None,
        None,
        "error",
    )
    last = a.take(RID, delta(0, [6], "length"))
    assert (last.finish_reason, last.error) == ("error", "the engine failed this request")


@pytest.mark.parametrize("end", ["error", "abort"])
def test_answer_0_ending_badly_at_once_ends_the_request_and_starts_no_other(end: str) -> None:
    a = answers(3)
    last = a.take(RID, delta(0, [], end))
    assert a.ended and a.later == [] and last.finish_reason == end


def test_answer_0_ending_well_at_once_still_starts_the_others() -> None:
    a = answers(2)
    assert a.take(RID, delta(0, [5], "length")).finish_reason is None  # max_tokens 1
    assert a.start_later(lambda eid, params: None) is None and a.live == {f"{RID}.1": 1}
    assert a.take(f"{RID}.1", delta(1, [4], "length")).finish_reason == "length"


def test_later_answers_the_engine_refuses_end_the_request_in_error() -> None:
    a = answers(3)
    a.take(RID, delta(0, [5], "length"))

    def refuse(eid: str, params: Any) -> None:
        raise ValueError("no room")

    last = a.start_later(refuse)
    assert last is not None and last.finish_reason == "error"
    assert last.error is not None and "answer 1 rejected: no room" in last.error


# ---- where P's first token is one engine's -------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, True),
        ({"temperature": 0.7}, True),  # unseeded: P's draw is as good as D's
        ({"repetition_penalty": 1.3, "min_p": 0.1, "logit_bias": {3: 2.0}}, True),  # per step
        ({"ignore_eos": True, "stop": ["x"], "top_k": 4}, True),
        ({"temperature": 0.7, "seed": 3}, False),
        ({"n": 2}, False),
        ({"logprobs": 0}, False),
        ({"prompt_logprobs": 1}, False),
        ({"presence_penalty": 0.1}, False),
        ({"frequency_penalty": -0.1}, False),
        ({"min_tokens": 1}, False),
        ({"bad_words": ["b"]}, False),
        ({"allowed_token_ids": [1, 2]}, False),
        ({"structured_outputs": StructuredOutputs(regex="a+")}, False),
    ],
)
def test_prefill_samples_the_first_token_only_where_the_answer_s_history_does_not_matter(
    fields: dict[str, Any], expected: bool
) -> None:
    spec = SamplingSpec(**{"temperature": 0.0, **fields})
    assert samples_on_prefill(spec) is expected
    # vLLM's SamplingParams has the same names; one that lacks a field reads as its default
    assert samples_on_prefill(SimpleNamespace(**{"temperature": 0.0, **fields})) is expected


def test_prefill_s_own_sampling_is_one_plain_answer() -> None:
    spec = SamplingSpec(
        max_tokens=9, n=4, temperature=0.5, logprobs=3, prompt_logprobs=2, top_k=7,
        structured_outputs=StructuredOutputs(choice=["a", "b"]), logit_bias={1: 1.0},
    )  # fmt: skip
    assert prefill_sampling(spec) == SamplingSpec(
        max_tokens=1, temperature=0.5, top_k=7, logit_bias={1: 1.0}
    )
    assert (PREFILL_SAMPLING.n, PREFILL_SAMPLING.logprobs, PREFILL_SAMPLING.max_tokens) == (
        1,
        None,
        1,
    )


def event(mode: str = "push", **sampling: Any) -> RequestEvent:
    return RequestEvent(
        transfer_id="t" * 8, request_id="r", prefill_id="p0", decode_id="d0", model="m",
        prompt_token_ids=[1, 2], reply_subject="kvpush.v1.tokens.gw", deadline_ms=0,
        sampling=SamplingSpec(**sampling), mode=TransferMode(mode),
    )  # fmt: skip


def test_a_worker_s_queue_depth_counts_what_waits_for_its_own_prefill() -> None:
    """On D a push/pull request waits for P's KV (a step once it lands), not for D's prefill;
    on P every request not past its first output does."""
    local, push = InFlight(event("local")), InFlight(event("push"))
    assert local.queued_for_prefill(WorkerRole.DECODE)
    assert not push.queued_for_prefill(WorkerRole.DECODE)
    assert push.queued_for_prefill(WorkerRole.PREFILL)
    local.handle = RequestHandle("t")
    local.handle.first_output_at = 1.0  # past its first output: decoding
    assert not local.queued_for_prefill(WorkerRole.DECODE)


def test_prefill_leaves_a_request_for_the_prompt_s_logprobs_to_decode() -> None:
    accepts = PrefillWorker.accepts
    assert accepts(None, event())  # type: ignore[arg-type]
    assert not accepts(None, event(prompt_logprobs=1))  # type: ignore[arg-type]
    assert not accepts(None, event("local"))  # type: ignore[arg-type]


# ---- an answer's delta in a TokenChunk -----------------------------------------------------
def test_a_chunk_carries_outputs_only_for_several_answers_or_logprobs() -> None:
    assert not wants_outputs(event()) and not wants_outputs(event(temperature=0.0, seed=1))
    assert wants_outputs(event(n=2)) and wants_outputs(event(logprobs=0))
    assert wants_outputs(event("local", prompt_logprobs=0))
    out = EngineOutput(RID, [4, 5], "ab", index=1, logprobs=[[TokenLogprob(4, -0.5, 1, "a")]] * 2)
    assert chunk_fields(out, False) == {"token_ids": [4, 5], "text": "ab"}
    (seq,) = chunk_fields(out, True)["outputs"]
    assert (seq.index, seq.token_ids, seq.text, seq.finish_reason) == (1, [4, 5], "ab", None)
    ended = dataclasses.replace(out, token_ids=[], text="", sequence_finish_reason="stop")
    assert chunk_fields(ended, True)["outputs"][0].finish_reason == "stop"  # no tokens, an end
    aborted = EngineOutput(RID, [], "", "abort")  # the request's end, no answer's
    assert chunk_fields(aborted, True) == {"outputs": []}
