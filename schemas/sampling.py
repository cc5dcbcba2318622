"""What a request asks of the decode engine and what it answers beyond tokens: ``SamplingSpec``
(every ``SamplingParams`` field vLLM's OpenAI layer sets, with bounds), ``StructuredOutputs``
(a grammar for the answer), ``TokenLogprob`` (one candidate token's log-probability) and
``SequenceOutput`` (the delta of one of a request's ``n`` answers).

``SamplingSpec``'s field names are ``SamplingParams``' names: the gateway builds it from the
params vLLM's own protocol models made (``to_sampling_params``: request fields, the model's
generation-config defaults, the clamped ``max_tokens``), D builds ``SamplingParams(**fields)``
back. Plain fields only: the gateway and the workers may run different vLLM versions.

Threading model: none (immutable values).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta

MAX_OUTPUT_TOKENS: Final = 131_072
MAX_TOKEN_ID: Final = 2**31 - 1
MAX_STOP_STRINGS: Final = 16
MAX_N: Final = 128  # answers of one request (vLLM: no bound)
MAX_LOGPROBS: Final = 20  # top candidates per position (vLLM's default max_logprobs)
MAX_BIASED_TOKENS: Final = 4096  # logit_bias entries, allowed_token_ids, bad_words
MAX_GRAMMAR_CHARS: Final = 256 * 1024  # a JSON schema, regex or grammar as text

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Grammar = Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class StructuredOutputs(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    """vLLM's ``StructuredOutputsParams``: exactly one of json/regex/choice/grammar/json_object/
    structural_tag constrains the answer (``json``: a JSON schema as text)."""

    json: Grammar | None = None
    regex: Grammar | None = None
    choice: Annotated[list[Grammar], Meta(max_length=MAX_BIASED_TOKENS)] | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None
    structural_tag: Grammar | None = None
    whitespace_pattern: Grammar | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class SamplingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sampling parameters, already validated and defaulted by the gateway."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)] = 16
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_OUTPUT_TOKENS)] = 0
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=1000.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=1_000_000)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] = 1.0
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=MAX_STOP_STRINGS)
    ] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=256)] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=-1, le=MAX_LOGPROBS)] | None = None  # per answer token
    prompt_logprobs: Annotated[int, Meta(ge=-1, le=MAX_LOGPROBS)] | None = None
    logit_bias: Annotated[dict[int, float], Meta(max_length=MAX_BIASED_TOKENS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_BIASED_TOKENS)] | None = None
    bad_words: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=256)] = []
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One candidate at one position, ``[token_id, logprob, rank, decoded]`` on the wire;
    ``logprob`` is never below -9999.0 (JSON has no -inf; vLLM's server prints that floor)."""

    token_id: TokenId
    logprob: float
    rank: Annotated[int, Meta(ge=0)] | None = None
    decoded: Annotated[str, Meta(max_length=4096)] | None = None


# the candidates of one position: the chosen token first, then the top ones (vLLM's order)
PositionLogprobs = Annotated[list[TokenLogprob], Meta(max_length=2 * MAX_LOGPROBS + 1)]


class SequenceOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The new part of answer ``index`` (of ``n``) since the previous chunk; ``finish_reason``
    once it ended (``stop_reason``: the stop string or token that ended it)."""

    index: Annotated[int, Meta(ge=0, lt=MAX_N)] = 0
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_OUTPUT_TOKENS)] = []
    text: Annotated[str, Meta(max_length=1_000_000)] = ""
    logprobs: Annotated[list[PositionLogprobs], Meta(max_length=MAX_OUTPUT_TOKENS)] | None = None
    cumulative_logprob: float | None = None
    finish_reason: Annotated[str, Meta(max_length=32)] | None = None
    stop_reason: int | Annotated[str, Meta(max_length=256)] | None = None
