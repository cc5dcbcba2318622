"""``delta_of`` turns vLLM's outputs (asked for with ``SamplingSpec.logprobs`` and
``prompt_logprobs``) into ``TokenLogprob``s in vLLM's order, from a list of dicts or vLLM
0.32's ``FlatLogprobs`` (both iterate positions of token id -> ``Logprob``), never below the
-9999 floor; a handle's ``result`` joins one answer's deltas in order; ``sequence_output`` is
an answer's delta as the bus carries it. vLLM's objects are stand-ins: no vllm import here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import msgspec

from kvpush.schemas.messages import SamplingSpec, TokenChunk
from kvpush.schemas.sampling import SequenceOutput, TokenLogprob
from kvpush.services.workers.handles import (
    LOGPROB_FLOOR,
    RequestHandle,
    delta_of,
    prompt_logprobs_of,
    sequence_output,
)


def lp(logprob: float, rank: int | None = None, decoded: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=decoded)


class Flat:
    """What vLLM 0.32's ``FlatLogprobs`` is to a reader: positions, each a fresh dict (an empty
    one for a prompt's first position), built on access; no list of dicts behind it."""

    def __init__(self, positions: list[dict[int, Any] | None]) -> None:
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    def __iter__(self) -> Iterator[dict[int, Any]]:
        for position in self._positions:
            yield dict(position or {})


def _delta(
    tokens: list[int],
    logprobs: Any,
    finished: bool,
    reason: str = "length",
    prompt_logprobs: Any = None,
    cumulative: float | None = None,
    stop: Any = None,
) -> object:
    choice = SimpleNamespace(
        token_ids=tokens, text="x" * len(tokens), logprobs=logprobs,
        finish_reason=reason if finished else None, stop_reason=stop,
        cumulative_logprob=cumulative,
    )  # fmt: skip
    return SimpleNamespace(
        request_id="r", outputs=[choice], finished=finished, kv_transfer_params=None,
        num_cached_tokens=0, prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


def test_logprobs_keep_vllm_s_order_rank_and_decoded_token_and_join_in_order() -> None:
    first = delta_of(_delta([5], [{5: lp(-0.1, 1, "a"), 7: lp(-2.5, 2, "b")}], False))
    assert first.logprobs == [[TokenLogprob(5, -0.1, 1, "a"), TokenLogprob(7, -2.5, 2, "b")]]
    handle = RequestHandle("r")
    handle._push(first)
    # the sampled token (rank 3) first, then the top ones: vLLM's dict order, kept
    second = [{9: lp(-0.2, 1, "c")}, {3: lp(-1.3, 3, "d"), 4: lp(-0.3, 1, "e")}]
    handle._push(delta_of(_delta([9, 3], second, True)))
    out = handle.result(timeout=1)
    assert out.token_ids == [5, 9, 3] and out.finish_reason == "length"
    assert [[c.token_id for c in pos] for pos in out.logprobs or []] == [[5, 7], [9], [3, 4]]
    assert out.logprobs[2][0] == TokenLogprob(3, -1.3, 3, "d")  # type: ignore[index]
    plain = delta_of(_delta([1], None, True))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert SamplingSpec(logprobs=8).logprobs == 8 and SamplingSpec().logprobs is None


def test_flat_logprobs_read_as_a_list_of_dicts_and_the_prompt_s_first_position_is_none() -> None:
    positions = [{5: lp(-0.1, 1, "a"), 7: lp(-2.5, 2, "b")}, {6: lp(-0.7, 1, "c")}]
    listed = delta_of(_delta([5, 6], positions, False))
    flat = delta_of(_delta([5, 6], Flat(positions), False))  # type: ignore[arg-type]
    assert flat.logprobs == listed.logprobs and len(flat.logprobs or []) == 2
    prompt: list[dict[int, Any] | None] = [None, {11: lp(-3.0, 4, "p"), 2: lp(-0.5, 1, "q")}]
    as_list = prompt_logprobs_of(prompt)
    as_flat = prompt_logprobs_of(Flat(prompt))
    assert (
        as_list
        == as_flat
        == [None, [TokenLogprob(11, -3.0, 4, "p"), TokenLogprob(2, -0.5, 1, "q")]]
    )
    out = delta_of(_delta([5], [positions[0]], False, prompt_logprobs=Flat(prompt)))
    assert out.prompt_logprobs == as_list
    # vLLM's later DELTA outputs: an emptied container, not None
    assert delta_of(_delta([6], None, False, prompt_logprobs=[])).prompt_logprobs is None
    assert delta_of(_delta([6], None, False, prompt_logprobs=Flat([]))).prompt_logprobs is None


def test_logprobs_never_go_below_the_floor_and_cumulative_stays_finite() -> None:
    positions = [
        {1: lp(-math.inf, 1, "a"), 2: lp(math.nan, 2, None), 3: lp(-12345.0, 3, "z" * 9000)}
    ]
    out = delta_of(_delta([1], positions, False, cumulative=-math.inf))
    assert [c.logprob for c in out.logprobs[0]] == [LOGPROB_FLOOR] * 3  # type: ignore[index]
    assert out.logprobs[0][1].decoded is None  # type: ignore[index]
    assert len(out.logprobs[0][2].decoded or "") == 4096  # type: ignore[index]
    assert out.cumulative_logprob == LOGPROB_FLOOR
    assert delta_of(_delta([1], positions, False, cumulative=math.nan)).cumulative_logprob is None
    assert (
        delta_of(_delta([1], positions, False, cumulative=-20000.5)).cumulative_logprob == -20000.5
    )
    json = msgspec.json.encode(out.logprobs)
    assert b"inf" not in json.lower() and b"nan" not in json.lower()


def test_an_answer_s_delta_goes_on_the_bus_with_its_index_and_its_own_end() -> None:
    positions = [{8: lp(-0.25, 1, "h")}]
    delta = delta_of(_delta([8], positions, True, "stop", cumulative=-0.25, stop="ab" * 200), 2)
    assert (delta.index, delta.sequence_finish_reason, delta.finish_reason) == (2, "stop", "stop")
    seq = sequence_output(delta)
    assert seq == SequenceOutput(
        index=2,
        token_ids=[8],
        text="x",
        logprobs=[[TokenLogprob(8, -0.25, 1, "h")]],
        cumulative_logprob=-0.25,
        finish_reason="stop",
        stop_reason="ab" * 128,  # bounded as the schema has it
    )
    running = sequence_output(delta_of(_delta([8], positions, False, stop=7)))
    assert (running.finish_reason, running.stop_reason) == (None, None)
    length = sequence_output(delta_of(_delta([8], None, True, "length", stop=7)))
    assert (length.finish_reason, length.stop_reason, length.logprobs) == ("length", None, None)
    chunk = TokenChunk(request_id="r", transfer_id="t" * 8, seq=0, outputs=[seq])
    wire = msgspec.json.decode(msgspec.json.encode(chunk), type=TokenChunk)
    assert wire.outputs == [seq] and wire.token_ids == [] and wire.text == ""


def test_a_handle_s_result_joins_one_answer_of_several() -> None:
    handle = RequestHandle("r")
    for index, tokens, done in ((0, [1], False), (1, [7], False), (0, [2], True), (1, [8], True)):
        out = delta_of(_delta(tokens, None, done), index)
        handle._push(out if (index, done) == (1, True) else _running(out))
    zero, one = handle.result(1), handle.result(1, index=1)
    assert (zero.token_ids, zero.index, zero.sequence_finish_reason) == ([1, 2], 0, "length")
    assert (one.token_ids, one.index, one.finish_reason) == ([7, 8], 1, "length")


def _running(out: Any) -> Any:
    """``out`` as the request's non-final output (the host's fan-out does that)."""
    import dataclasses

    return dataclasses.replace(out, finish_reason=None, error=None)
