"""P's first token, piece by piece: who samples it (the gateway's rule), when D's connector
reports a receive that asked for it (the decode side's wait), how the answer ends with it (the
scheduler half's decision), and the one change to a vLLM ``Request``
(``compat.continue_from``, on a real one, in a child process). That D's answers stay one engine's is
the integration suite's job (tests/integration/test_first_token.py, test_workers.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpush.connector.params import (
    ConnectorSettings,
    DecodeWork,
    PrefillToken,
    ReceiveKind,
    TransferParams,
    first_token_end,
)
from kvpush.connector.transfer import Role, TransferEvent, TransferState
from kvpush.connector.vllm.decode_side import DecodeSide
from kvpush.connector.vllm.runtime import WorkerRuntime
from kvpush.connector.vllm.side import Rank
from kvpush.schemas.messages import (
    Abort,
    FailReason,
    FinishReason,
    FirstToken,
    KvFailed,
    SamplingSpec,
    TransferMode,
    WorkerRole,
)
from kvpush.services.gateway.routing import Route, first_token_by
from kvpush.services.workers.first_token import first_token_of, prefill_sampling
from kvpush.services.workers.handles import EngineOutput
from tests.unit.test_connector_sides import BLOCK, TID, Recorder

PUSH, PULL, LOCAL = TransferMode.PUSH, TransferMode.PULL, TransferMode.LOCAL
P, D = WorkerRole.PREFILL, WorkerRole.DECODE


# ---- who samples it ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("choice", "mode", "sends", "spec", "expected"),
    [
        (P, PUSH, True, SamplingSpec(temperature=0.0), P),
        (P, PULL, True, SamplingSpec(temperature=0.7), P),  # unseeded: P's draw is as good
        (P, PUSH, True, SamplingSpec(temperature=0.0, seed=3), P),  # greedy: no draw
        (P, PUSH, True, SamplingSpec(temperature=0.7, seed=3), D),  # D's draws would shift
        (P, PUSH, True, SamplingSpec(temperature=0.0, logprobs=2), D),  # not on the bus yet
        (P, PUSH, False, SamplingSpec(temperature=0.0), D),  # an older P sends none
        (P, LOCAL, True, SamplingSpec(temperature=0.0), D),  # nothing moves: D does it all
        (D, PUSH, True, SamplingSpec(temperature=0.0), D),  # the deployment said so
    ],
)
def test_the_gateway_lets_prefill_sample_the_first_token_where_one_engine_would_agree(
    choice: WorkerRole, mode: TransferMode, sends: bool, spec: SamplingSpec, expected: WorkerRole
) -> None:
    route = Route("p0", "d0", mode, 1, 1 if mode is not LOCAL else None, sends and mode != LOCAL)
    assert first_token_by(choice, route, spec) is expected


def test_prefill_samples_one_token_with_the_request_s_own_sampling() -> None:
    spec = SamplingSpec(max_tokens=9, min_tokens=4, temperature=0.5, top_k=7, stop=["x"])
    assert prefill_sampling(spec) == SamplingSpec(
        max_tokens=1, min_tokens=1, temperature=0.5, top_k=7, stop=["x"]
    )


@pytest.mark.parametrize(
    ("reason", "stop", "finish", "sent_stop"),
    [
        ("length", None, None, None),  # the one token P was asked for: not the answer's end
        ("stop", None, FinishReason.STOP, None),  # end of sequence
        ("stop", 7, FinishReason.STOP, 7),  # a stop token
        ("stop", "ab" * 200, FinishReason.STOP, "ab" * 128),  # a stop string, bounded
    ],
)
def test_prefill_s_first_token_says_whether_it_ends_the_answer(
    reason: str, stop: Any, finish: FinishReason | None, sent_stop: Any
) -> None:
    final = EngineOutput("r", [42], "t", reason, stop_reason=stop)
    token = first_token_of(TID, "p0", "d0", final)
    assert (token.token_id, token.finish_reason, token.stop_reason) == (42, finish, sent_stop)


# ---- the decode side waits for it ----------------------------------------------------------
def decode(wait_s: float = 2.0) -> tuple[DecodeSide, Recorder, list[int]]:
    woken: list[int] = []
    settings = ConnectorSettings(worker_id="d0", role=WorkerRole.DECODE, first_token_wait_s=wait_s)
    rec = Recorder()
    side = DecodeSide(settings, rec, rec, WorkerRuntime(lambda: woken.append(1)), Rank(), BLOCK)  # type: ignore[arg-type]
    return side, rec, woken


def asking(kind: ReceiveKind = ReceiveKind.PUSH, mode: TransferMode = PUSH) -> list[DecodeWork]:
    params = TransferParams(TID, "p0", "d0", mode, first_token_from_prefill=True)
    return [DecodeWork(kind, "r0", params, [5, 6], 0, 8)]


def token(token_id: int = 42, **fields: Any) -> FirstToken:
    return FirstToken(transfer_id=TID, prefill_id="p0", decode_id="d0", token_id=token_id, **fields)


DONE = TransferEvent(TID, Role.TARGET, TransferState.DONE, quiesced=True)


def test_a_landed_receive_is_reported_once_prefill_s_token_came_and_takes_it_up() -> None:
    side, _, woken = decode()
    side.on_work(asking())
    assert side.collect([DONE]) == (set(), {})  # the KV is in, the token is not
    side.on_bus("", token(finish_reason=FinishReason.STOP, stop_reason=9))
    assert woken  # the driver steps at once to report it
    assert side.collect([]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42, "stop", 9)}
    assert side.take_first_tokens() == {} and not side._by_tid


def test_a_token_before_the_request_is_kept_for_it() -> None:
    side, _, _ = decode()
    side.on_bus("", token())  # P's service was quicker than D's engine
    side.on_work(asking(ReceiveKind.PULL, PULL))
    assert side.collect([DONE]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42)}


def test_without_prefill_s_token_the_receive_is_reported_after_the_wait() -> None:
    side, _, _ = decode(wait_s=0.0)
    side.on_work(asking())
    assert side.collect([DONE]) == ({"r0"}, {})  # waited 0 s: D samples the token itself
    assert side.take_first_tokens() == {}


def test_a_failed_receive_never_waits_and_carries_no_token() -> None:
    side, _, _ = decode()
    side.on_work(asking())
    side.on_bus("", token())
    side.on_bus(
        "", KvFailed(transfer_id=TID, prefill_id="p0", decode_id="d0", reason=FailReason.POST)
    )
    failed = TransferEvent(TID, Role.TARGET, TransferState.FAILED, quiesced=True)
    assert side.collect([failed]) == (set(), {"r0": [5, 6]})  # D computes the whole answer
    assert side.take_first_tokens() == {}


def test_a_request_ended_while_waiting_for_the_token_gives_its_blocks_back_without_it() -> None:
    side, _, _ = decode()
    side.on_work(asking())
    assert side.collect([DONE]) == (set(), {})  # landed, waiting for P's token
    params = TransferParams(TID, "p0", "d0", PUSH, first_token_from_prefill=True)
    side.on_work([DecodeWork(ReceiveKind.ABORT, "r0", params)])  # the client left
    assert side.collect([]) == ({"r0"}, {})  # reported: vLLM frees the blocks
    assert side.take_first_tokens() == {} and not side._by_tid


def test_late_word_from_prefill_on_a_landed_receive_changes_nothing() -> None:
    side, rec, _ = decode()
    side.on_work(asking())
    side.collect([DONE])
    refusal = KvFailed(transfer_id=TID, prefill_id="p0", decode_id="d0", reason=FailReason.POST)
    side.on_bus("", refusal)  # e.g. a KvFailed that crossed the notice
    assert not rec.messages(Abort)  # no abort sent for KV that already landed
    side.on_bus("", token())
    assert side.collect([]) == ({"r0"}, {})
    assert side.take_first_tokens() == {"r0": PrefillToken(42)}


def test_a_late_token_of_a_prompt_decode_computes_itself_is_dropped() -> None:
    side, _, _ = decode()
    params = TransferParams(TID, "p0", "d0", PUSH, first_token_from_prefill=True)
    side.on_work([DecodeWork(ReceiveKind.LOCAL, "r0", params)])
    side.on_bus("", token())
    assert TID not in side._early and not side._by_tid


# ---- how the answer ends with it (the scheduler half's decision) ---------------------------
@pytest.mark.parametrize(
    ("first", "max_tokens", "num_tokens", "expected"),
    [
        (PrefillToken(42), 8, 8, PrefillToken(42)),  # the request goes on from it
        (PrefillToken(42, "stop"), 8, 8, PrefillToken(42, "stop")),  # end of sequence
        (PrefillToken(42, "stop", 42), 8, 8, PrefillToken(42, "stop", 42)),  # a stop token
        # a stop string: D's detokenizer ends the answer; the request goes on meanwhile
        (PrefillToken(42, "stop", "\n"), 8, 8, PrefillToken(42, None, "\n")),
        (PrefillToken(42), 1, 8, PrefillToken(42, "length")),  # one token asked for
        (PrefillToken(42), 8, 999, PrefillToken(42, "length")),  # the token fills the context
    ],
)
def test_the_answer_ends_with_the_token_as_one_engine_s_stop_check_says(
    first: PrefillToken, max_tokens: int, num_tokens: int, expected: PrefillToken
) -> None:
    assert first_token_end(first, max_tokens, num_tokens, max_model_len=1000) == expected
