"""The gateway's engine client without a server: ``engine_client.spec_of`` (vLLM's
``SamplingParams`` as the bus carries them) and ``engine_client.Outputs`` (a decode worker's
chunks as vLLM ``RequestOutput``s). An integration test only because it imports vLLM (the unit
tier stays vLLM-free).

Threading model: none (pure functions on the test's thread).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpush.schemas.messages import FinishReason, TokenChunk
from kvpush.schemas.sampling import MAX_N, StructuredOutputs


@pytest.fixture
def vllm_params() -> Any:
    """vLLM's ``sampling_params`` module (imported at run time, not at collection)."""
    from vllm import sampling_params

    return sampling_params


def test_spec_of_carries_vllm_s_params_onto_the_bus(vllm_params: Any) -> None:
    from kvpush.services.gateway.engine_client import spec_of

    params = vllm_params.SamplingParams(
        n=2,
        temperature=0.5,
        top_k=7,
        seed=3,
        max_tokens=9,
        min_tokens=2,
        stop=["zz"],
        stop_token_ids=[4],
        ignore_eos=True,
        logprobs=3,
        logit_bias={5: -1},
        structured_outputs=vllm_params.StructuredOutputsParams(json={"type": "object"}),
    )
    spec = spec_of(params)
    assert (spec.n, spec.temperature, spec.top_k, spec.seed) == (2, 0.5, 7, 3)
    assert (spec.max_tokens, spec.min_tokens, spec.stop, spec.stop_token_ids) == (9, 2, ["zz"], [4])
    assert (spec.ignore_eos, spec.logprobs, spec.logit_bias) == (True, 3, {5: -1.0})
    assert isinstance(spec.structured_outputs, StructuredOutputs)
    assert json.loads(spec.structured_outputs.json or "") == {"type": "object"}  # as text
    assert spec_of(vllm_params.SamplingParams()).structured_outputs is None


def test_spec_of_refuses_what_the_bus_can_not_carry(vllm_params: Any) -> None:
    from kvpush.services.gateway.engine_client import spec_of

    with pytest.raises(ValueError, match="out of kvpush's bounds"):
        spec_of(vllm_params.SamplingParams(n=MAX_N + 1))


def test_outputs_are_deltas_for_a_stream_and_one_whole_answer_otherwise() -> None:
    from kvpush.services.gateway.engine_client import Outputs

    chunks = [
        TokenChunk("r", "t", seq=0, token_ids=[7], text="a"),
        TokenChunk("r", "t", seq=1, token_ids=[8], text="b", finish_reason=FinishReason.STOP),
    ]
    stream = Outputs("r", [1, 2], final_only=False)
    deltas = [stream.of(chunk) for chunk in chunks]
    assert [d.outputs[0].text for d in deltas if d] == ["a", "b"]
    assert [d.finished for d in deltas if d] == [False, True]
    whole = Outputs("r", [1, 2], final_only=True)
    assert whole.of(chunks[0]) is None  # nothing until the end
    answer = whole.of(chunks[1])
    assert answer is not None and answer.prompt_token_ids == [1, 2]
    [out] = answer.outputs
    assert (out.text, out.token_ids, out.finish_reason) == ("ab", [7, 8], "stop")
