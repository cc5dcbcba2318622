"""The soak's judgement of single answers, on synthetic answers (no stack)."""

from __future__ import annotations

import pytest

from kvpush.benchmarks.soak.checks import (
    FAST_ERROR_S,
    LOAD,
    Answer,
    Category,
    Delivery,
    ErrorInfo,
    Observed,
    Reference,
    judge,
    parse_error_body,
    path_of,
    stream_error,
)

REF = Reference("a b c", (5, 6, 7))


def seen(ids: tuple[int, ...] = (5, 6, 7), *, complete: bool = True, mode: str = "push",
         landed: bool = True) -> Observed:  # fmt: skip
    return Observed(ids, complete, mode, landed)


def ok(delivery: Delivery = Delivery.JSON, text: str = "a b c") -> Answer:
    return Answer(delivery, 200, "cmpl-1", text)


def error(status: int, type_: str, code: str | None, message: str) -> ErrorInfo:
    return ErrorInfo(status, type_, code, message)


def test_a_200_with_the_reference_token_ids_is_ok_and_named_by_its_path() -> None:
    assert judge(ok(), REF, seen(), LOAD).category is Category.OK
    assert judge(ok(Delivery.STREAM), REF, seen(), LOAD).path == "push/received"
    assert path_of(seen(mode="pull", landed=False)) == "pull/fallback"
    assert path_of(seen(mode="local", landed=False)) == "local"
    assert path_of(None) == "unknown"


def test_a_prompt_d_held_in_its_prefix_cache_is_cached_not_fallback() -> None:
    held = Observed((5, 6, 7), True, "push", False, kv_cached=True)
    assert path_of(held) == "push/cached"
    assert judge(ok(), REF, held, LOAD).path == "push/cached"
    landed = Observed((5, 6, 7), True, "pull", True, kv_cached=True)  # received wins
    assert path_of(landed) == "pull/received"


def test_other_token_ids_are_wrong_even_when_the_text_matches() -> None:
    verdict = judge(ok(), REF, seen((5, 6, 8)), LOAD)
    assert verdict.category is Category.WRONG and "token ids" in verdict.detail


def test_other_text_is_wrong_even_when_the_ids_match() -> None:
    assert judge(ok(text="a b d"), REF, seen(), LOAD).category is Category.WRONG


def test_a_200_whose_chunks_were_not_all_seen_is_unverified_not_ok() -> None:
    assert judge(ok(), REF, seen((5,), complete=False), LOAD).category is Category.UNVERIFIED
    assert judge(ok(), REF, None, LOAD).category is Category.UNVERIFIED
    assert judge(ok(), REF, seen((9,), complete=False), LOAD).category is Category.WRONG


def test_an_aborted_stream_must_be_a_prefix_of_the_reference() -> None:
    abort = Answer(Delivery.ABORT, 200, "cmpl-2", "a")
    assert judge(abort, REF, seen((5, 6), complete=False), LOAD).category is Category.ABORTED
    assert judge(abort, REF, seen((5, 9), complete=False), LOAD).category is Category.WRONG
    wrong_text = Answer(Delivery.ABORT, 200, "cmpl-2", "x")
    assert judge(wrong_text, REF, None, LOAD).category is Category.WRONG


@pytest.mark.parametrize(
    ("window", "err", "expected"),
    [
        (
            "kill_prefill",
            error(503, "service_unavailable", "no_workers", "no prefill worker is available"),
            True,
        ),
        (
            "kill_prefill",
            error(503, "service_unavailable", "no_workers", "no decode worker is available"),
            False,
        ),
        (
            "kill_decode",
            error(502, "worker_error", None, "decode worker soak-d was lost or restarted"),
            True,
        ),
        ("kill_decode", error(502, "worker_error", None, "worker error: overloaded"), False),
        # the gateway fails a request stalled across a nats-server restart fast, not at 60 s
        ("restart_nats", error(504, "timeout", "timeout", "request timed out after 60 s"), False),
        ("stop_decode", error(504, "timeout", "timeout", "request timed out after 60 s"), False),
        (
            "burst",
            error(
                429,
                "rate_limit_error",
                "rate_limit_exceeded",
                "too many requests in flight (limit 8); retry later",
            ),
            True,
        ),
        (
            "restart_nats",
            error(503, "service_unavailable", None, "the message bus is unavailable"),
            True,
        ),
        (
            "kill_decode",
            error(503, "service_unavailable", None, "the message bus is unavailable"),
            False,
        ),
        (
            LOAD,
            error(503, "service_unavailable", "no_workers", "no decode worker is available"),
            False,
        ),
    ],
)
def test_an_error_is_expected_only_while_a_fault_explains_it(
    window: str, err: ErrorInfo, expected: bool
) -> None:
    verdict = judge(Answer(Delivery.JSON, err.status, error=err), REF, None, window)
    assert verdict.category is (Category.EXPECTED_ERROR if expected else Category.UNEXPECTED)
    assert str(err.status) in verdict.detail


LOST_D = error(502, "worker_error", None, "decode worker soak-d1 was lost or restarted")
NO_P = error(503, "service_unavailable", "no_workers", "no prefill worker is available")
NO_D = error(503, "service_unavailable", "no_workers", "no decode worker is available")


@pytest.mark.parametrize(
    ("window", "err"),
    [
        ("kill_decode", LOST_D),
        ("stop_decode", NO_D),
        ("kill_prefill", NO_P),
        ("stop_prefill", NO_P),
    ],
)
def test_with_a_second_worker_of_its_role_a_kill_or_stop_explains_no_error(
    window: str, err: ErrorInfo
) -> None:
    answer = Answer(Delivery.JSON, err.status, error=err)
    alone = judge(answer, REF, None, window, prefill=1, decode=1)
    assert alone.category is Category.EXPECTED_ERROR
    redundant = judge(answer, REF, None, window, prefill=2, decode=2)
    assert redundant.category is Category.UNEXPECTED


def test_only_the_victims_role_counts_for_redundancy() -> None:
    answer = Answer(Delivery.JSON, 502, error=LOST_D)
    assert judge(answer, REF, None, "kill_decode", prefill=2, decode=1).category is (
        Category.EXPECTED_ERROR
    )
    answer = Answer(Delivery.JSON, 503, error=NO_P)
    assert judge(answer, REF, None, "stop_prefill", prefill=1, decode=2).category is (
        Category.EXPECTED_ERROR
    )


def test_a_nats_restarts_errors_must_come_fast_whatever_the_workers() -> None:
    fast = Answer(Delivery.JSON, 502, error=LOST_D, elapsed_s=3.0)
    late = Answer(Delivery.JSON, 502, error=LOST_D, elapsed_s=FAST_ERROR_S + 1)
    for n in (1, 2):
        verdict = judge(fast, REF, None, "restart_nats", prefill=n, decode=n)
        assert verdict.category is Category.EXPECTED_ERROR
        verdict = judge(late, REF, None, "restart_nats", prefill=n, decode=n)
        assert verdict.category is Category.UNEXPECTED and "after 16 s" in verdict.detail
    lost = error(503, "service_unavailable", None, "the message bus was interrupted and the "
                 "request was lost; retry it")  # fmt: skip
    answer = Answer(Delivery.STREAM, 200, "cmpl-4", error=lost, elapsed_s=5.0)
    assert judge(answer, REF, None, "restart_nats", prefill=2).category is Category.EXPECTED_ERROR


PROMPT = (1, 2, 3)
MOVED_REF = Reference("a b c", (5, 6, 7), PROMPT)


def test_a_moved_request_is_judged_by_its_last_transfer_after_the_tokens_already_sent() -> None:
    moved = Observed((6, 7), True, "push", True, prompt_ids=(*PROMPT, 5), moves=1)
    assert moved.answer_ids(PROMPT) == (5, 6, 7)
    assert judge(ok(), MOVED_REF, moved, "kill_decode", decode=2).category is Category.OK
    unmoved = Observed((5, 6, 7), True, "push", True, prompt_ids=PROMPT)
    assert judge(ok(), MOVED_REF, unmoved, LOAD).category is Category.OK


def test_a_moved_request_with_other_tokens_or_another_prompt_is_wrong() -> None:
    repeated = Observed((5, 6, 7), True, "push", True, prompt_ids=(*PROMPT, 5), moves=1)
    verdict = judge(ok(), MOVED_REF, repeated, "kill_decode", decode=2)
    assert verdict.category is Category.WRONG and "token ids" in verdict.detail
    elsewhere = Observed((6, 7), True, "push", True, prompt_ids=(9, 2, 3, 5), moves=1)
    verdict = judge(ok(), MOVED_REF, elsewhere, "kill_decode", decode=2)
    assert verdict.category is Category.WRONG and "prompt" in verdict.detail
    assert elsewhere.answer_ids(PROMPT) is None


def test_a_malformed_answer_is_unexpected_whatever_the_fault() -> None:
    bad = Answer(Delivery.STREAM, 200, "cmpl-3", problem="stream ended without [DONE]")
    assert judge(bad, REF, seen(), "restart_nats").category is Category.UNEXPECTED
    reset = Answer(Delivery.JSON, 0, problem="client: ClientOSError: reset")
    assert judge(reset, REF, None, "kill_decode").category is Category.UNEXPECTED


def test_only_the_openai_error_shape_is_an_error_body() -> None:
    body = {"error": {"message": "m", "type": "timeout", "param": None, "code": "timeout"}}
    assert parse_error_body(504, body) == ErrorInfo(504, "timeout", "timeout", "m")
    assert isinstance(parse_error_body(500, {"detail": "boom"}), str)
    assert isinstance(parse_error_body(502, {"error": {"message": "m", "type": "x"}}), str)
    empty = {"error": {"message": "", "type": "x", "param": None, "code": None}}
    assert isinstance(parse_error_body(502, empty), str)
    assert isinstance(parse_error_body(502, ["error"]), str)


def test_an_error_event_in_a_stream_takes_the_status_of_its_type() -> None:
    event = {"error": {"message": "decode worker soak-d was lost or restarted",
                       "type": "worker_error", "param": None, "code": None}}  # fmt: skip
    found = stream_error(event)
    assert isinstance(found, ErrorInfo) and found.status == 502 and found.in_stream
    assert stream_error({"choices": [{"text": "x"}]}) is None
    unknown = {"error": {"message": "m", "type": "odd", "param": None, "code": None}}
    assert isinstance(stream_error(unknown), str)
