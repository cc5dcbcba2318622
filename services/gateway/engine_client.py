"""``BusEngineClient``: vLLM's ``EngineClient`` whose engine is a kvpush P/D pair on the bus.

vLLM's serving layer (``vllm_serving``) renders and validates a request, then calls
``generate`` with the prompt's token ids and the ``SamplingParams`` it built. Here that becomes
one ``bus_generation.BusGeneration``: the params as a bounded ``SamplingSpec`` (``spec_of``;
validated by vLLM's own ``InputProcessor`` first, so what vLLM's engine client refuses is a
400 here too), one RequestEvent, and the decode worker's TokenChunks turned back into vLLM
``RequestOutput``s (``Outputs``): deltas for a stream, one whole output otherwise, as vLLM's
``AsyncLLM`` yields. Everything else the protocol asks of an engine client is a no-op or "not
supported": kvpush's engines live in the workers. The span ``gateway.render`` (the request's
context to its first engine request: vLLM's template and tokenization) is made here.

This module imports vLLM; the gateway imports it once it has built vLLM's serving layer.

Threading model: the gateway's event loop only.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import trace
from vllm.engine.protocol import EngineClient
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from kvpush.schemas.messages import TokenChunk
from kvpush.schemas.sampling import (
    SamplingSpec,
    SequenceOutput,
    StructuredOutputs,
    TokenLogprob,
)
from kvpush.services.gateway.bus_generation import (
    CURRENT,
    BusGeneration,
    RequestContext,
    bus_request_id,
)
from kvpush.services.gateway.errors import ApiError

if TYPE_CHECKING:
    from kvpush.services.gateway.bus_generation import GenerationHost
    from kvpush.services.gateway.vllm_serving import VllmServing

_tracer = trace.get_tracer("kvpush.gateway")
_SPEC_FIELDS = tuple(f for f in SamplingSpec.__struct_fields__ if f != "structured_outputs")


def spec_of(params: SamplingParams) -> SamplingSpec:
    """vLLM's params as the bus carries them (ValueError: outside the bus's bounds)."""
    fields = {name: getattr(params, name, None) for name in _SPEC_FIELDS}
    fields = {name: value for name, value in fields.items() if value is not None}
    for name in ("stop", "stop_token_ids", "bad_words"):
        fields[name] = list(fields.get(name) or [])
    if params.logit_bias:
        fields["logit_bias"] = {int(k): float(v) for k, v in params.logit_bias.items()}
    guide = params.structured_outputs
    if guide is not None:
        grammar = {
            name: getattr(guide, name)
            for name in StructuredOutputs.__struct_fields__
            if getattr(guide, name, None) not in (None, False)
        }
        if isinstance(grammar.get("json"), dict):
            grammar["json"] = json.dumps(grammar["json"])
        fields["structured_outputs"] = grammar
    try:
        return msgspec.convert(fields, SamplingSpec)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling parameters out of kvpush's bounds: {exc}") from None


def _position(candidates: list[TokenLogprob]) -> dict[int, Logprob]:
    return {c.token_id: Logprob(c.logprob, c.rank, c.decoded) for c in candidates}


def _logprobs(positions: list[list[TokenLogprob]] | None) -> list[dict[int, Logprob]] | None:
    return None if positions is None else [_position(p) for p in positions]


class Outputs:
    """A request's chunks as vLLM ``RequestOutput``s: each chunk's deltas, or (``final_only``)
    every answer accumulated into one output at the end."""

    def __init__(self, request_id: str, prompt_ids: list[int], final_only: bool) -> None:
        self.request_id, self.prompt_ids, self.final_only = request_id, prompt_ids, final_only
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.whole: dict[int, CompletionOutput] = {}

    @staticmethod
    def sequences(chunk: TokenChunk) -> list[SequenceOutput]:
        if chunk.outputs is not None:
            return chunk.outputs
        reason = chunk.finish_reason.value if chunk.finish_reason is not None else None
        return [
            SequenceOutput(
                token_ids=chunk.token_ids,
                text=chunk.text,
                finish_reason=reason,
                stop_reason=chunk.stop_reason,
            )
        ]

    def of(self, chunk: TokenChunk) -> RequestOutput | None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = [_position(p) if p else None for p in chunk.prompt_logprobs]
        finished = chunk.finish_reason is not None
        deltas = []
        for seq in self.sequences(chunk):
            out = CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=_logprobs(seq.logprobs),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            if self.final_only:
                self._add(out)
            else:
                deltas.append(out)
        if self.final_only:
            if not finished:
                return None
            deltas = [self.whole[i] for i in sorted(self.whole)]
        return RequestOutput(
            self.request_id,
            None,
            self.prompt_ids,
            self.prompt_logprobs,
            deltas,
            finished,
            num_cached_tokens=chunk.num_cached_tokens if finished else None,
        )

    def _add(self, delta: CompletionOutput) -> None:
        whole = self.whole.get(delta.index)
        if whole is None:
            self.whole[delta.index] = delta
            return
        whole.text += delta.text
        whole.token_ids = [*whole.token_ids, *delta.token_ids]
        if delta.logprobs is not None:
            whole.logprobs = [*(whole.logprobs or []), *delta.logprobs]
        whole.cumulative_logprob = delta.cumulative_logprob
        whole.finish_reason = delta.finish_reason or whole.finish_reason
        whole.stop_reason = delta.stop_reason if delta.finish_reason else whole.stop_reason


def _render_span(context: RequestContext, prompt_tokens: int) -> None:
    """``gateway.render``, once per request (its first engine request: a batch of prompts, and
    beam search, call ``generate`` more often): vLLM's serving layer's part (chat template,
    tokenization, sampling parameters), from the request's context to this engine request."""
    if context.rendered or not context.span.is_recording():
        return
    context.rendered = True
    parent = trace.set_span_in_context(context.span)
    attributes = {"gen_ai.usage.input_tokens": prompt_tokens}
    _tracer.start_span(
        "gateway.render", parent, start_time=context.arrived_ns, attributes=attributes
    ).end()


class BusEngineClient(EngineClient):
    """The engine client of vLLM's serving layer in the gateway; see the module docstring."""

    def __init__(self, serving: VllmServing, host: GenerationHost) -> None:
        self.vllm_config = serving.vllm_config
        self.model_config = serving.vllm_config.model_config
        self.renderer = serving.renderer
        self.input_processor = serving.input_processor
        self.host = host

    async def generate(  # type: ignore[override]
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        context = CURRENT.get() or RequestContext(span=trace.INVALID_SPAN)
        ids = list(prompt["prompt_token_ids"])
        _render_span(context, len(ids))
        # what vLLM's own engine client refuses (e.g. logprobs above max_logprobs) is a 400 here
        self.input_processor.process_inputs(
            request_id, prompt, sampling_params.clone(), supported_tasks=("generate",)
        )
        spec = spec_of(sampling_params)
        final_only = sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        outputs = Outputs(request_id, ids, final_only)
        generation = BusGeneration(self.host, context, self._bus_id(context, request_id))
        try:
            await generation.start(ids, spec, stream=not final_only)
            while True:
                chunk = await generation.next()
                result = outputs.of(chunk)
                if result is not None:
                    yield result
                if chunk.finish_reason is not None:
                    return
        finally:
            generation.finish()

    def _bus_id(self, context: RequestContext, request_id: str) -> str:
        """The answer's id for its first engine request (vLLM's id of a completion's prompt 0
        is ``<answer id>-0``); vLLM's id for the others; a suffix when a client reuses an
        X-Request-Id that is still streaming (ids on the bus are unique)."""
        first = request_id in (context.response_id, f"{context.response_id}-0")
        bus_id = bus_request_id(
            context.response_id if first and context.response_id else request_id
        )
        if bus_id in self.host.streams:
            bus_id = bus_request_id(f"{bus_id}-{secrets.token_hex(4)}")  # the suffix stays
        return bus_id

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise ApiError(400, "pooling models are not served by kvpush")


# The rest of the protocol (abort, health, profiling, sleep, pause, LoRA, caches, shutdown)
# concerns a local engine, and kvpush's engines live in the workers (a BusGeneration aborts
# itself when its generator closes): vLLM's abstract bodies, which do nothing and return None
# (so ``errored`` and ``is_tracing_enabled`` are falsy), serve as its no-ops.
BusEngineClient.__abstractmethods__ = frozenset()
