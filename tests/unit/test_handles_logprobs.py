"""``delta_of`` turns vLLM's per-token logprobs (asked for with ``SamplingSpec.logprobs``) into
plain dicts, and a handle's ``result`` joins them over the deltas in order."""

from __future__ import annotations

from types import SimpleNamespace

from kvpush.schemas.messages import SamplingSpec
from kvpush.services.workers.handles import RequestHandle, delta_of


def _delta(tokens: list[int], logprobs: list[dict[int, float]] | None, finished: bool) -> object:
    wrapped = None
    if logprobs is not None:
        wrapped = [{t: SimpleNamespace(logprob=lp) for t, lp in pos.items()} for pos in logprobs]
    choice = SimpleNamespace(
        token_ids=tokens, text="x" * len(tokens), logprobs=wrapped,
        finish_reason="length" if finished else None,
    )  # fmt: skip
    return SimpleNamespace(
        request_id="r", outputs=[choice], finished=finished, kv_transfer_params=None,
        num_cached_tokens=0,
    )  # fmt: skip


def test_logprobs_survive_deltas_and_join_in_order() -> None:
    first = delta_of(_delta([5], [{5: -0.1, 7: -2.5}], False))
    assert first.logprobs == [{5: -0.1, 7: -2.5}]
    handle = RequestHandle("r")
    handle._push(first)
    handle._push(delta_of(_delta([9, 3], [{9: -0.2}, {3: -0.3, 4: -1.0}], True)))
    out = handle.result(timeout=1)
    assert out.token_ids == [5, 9, 3]
    assert out.logprobs == [{5: -0.1, 7: -2.5}, {9: -0.2}, {3: -0.3, 4: -1.0}]
    plain = delta_of(_delta([1], None, True))
    assert plain.logprobs is None
    assert SamplingSpec(logprobs=8).logprobs == 8 and SamplingSpec().logprobs is None
