"""The answer's first token from the prefill worker: what P samples, and how D reports it.

vLLM's own P/D (and kvpush until now) throws away the token P's prefill samples and has D run
one more engine step after the KV landed to sample it again: on the H200 that step is a whole
decode step of the 8B shape. With ``first_token_by`` prefill on the RequestEvent (the gateway's
default for push and pull where P's token gives one engine's answer: ``routing.first_token_by``):

- P prefills with the request's own sampling, one token (``prefill_sampling``), and sends it
  to D as ``FirstToken`` (``first_token_of``; ``prefill.py``);
- D's connector reports the receive once the KV landed and that token came; the request then
  continues from it as its last prompt token (``connector/vllm/scheduler.py``), so D's first
  step computes the second token;
- D's engine driver reports the token as the request's first output (``report``): vLLM's
  output processor detokenizes it in its context and checks stop strings, so the text and
  every later delta read as one engine's; a token that ends the answer ends the request.

The gateway still hears only from D, so the stream is consistent whatever fails: without P's
token (an older P, a lost message) D samples it itself ``first_token_wait_s`` after the KV.

Threading model: ``report`` runs on the engine thread (``EngineHost``); the rest are pure.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvpush.connector import PrefillToken
from kvpush.schemas.messages import FinishReason, FirstToken
from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.workers.handles import EngineOutput


def prefill_sampling(spec: SamplingSpec) -> SamplingSpec:
    """P's sampling for a request whose first token it samples: the request's own, one token
    (``min_tokens`` at most 1, so an end of sequence is held back exactly as one engine would),
    one answer, without what only D reports (log-probabilities) or applies (a grammar): the
    gateway asks P for the token only where those are absent (``samples_on_prefill``)."""
    return msgspec.structs.replace(
        spec,
        max_tokens=1,
        min_tokens=min(spec.min_tokens, 1),
        n=1,
        logprobs=None,
        prompt_logprobs=None,
        structured_outputs=None,
    )


def first_token_of(
    transfer_id: str, prefill_id: str, decode_id: str, final: EngineOutput
) -> FirstToken:
    """P's ``FirstToken`` from its engine's final output of a one-token prefill: "length"
    is the one token asked for; "stop" (end of sequence, a stop token or string) ends the
    answer."""
    ended = final.finish_reason == "stop"
    stop = final.stop_reason if ended else None
    return FirstToken(
        transfer_id=transfer_id,
        prefill_id=prefill_id,
        decode_id=decode_id,
        token_id=final.token_ids[0],
        finish_reason=FinishReason.STOP if ended else None,
        stop_reason=stop[:256] if isinstance(stop, str) else stop,
    )


def report(engine: Any, tokens: list[tuple[str, PrefillToken]]) -> list[Any]:
    """Run P's first tokens through vLLM's output processor as the first output of their
    requests (vLLM's request ids), end the engine's requests whose answer ends with them, and
    return the ``RequestOutput``s to hand out."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    reasons = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
    outputs = [
        EngineCoreOutput(
            request_id=req_id,
            new_token_ids=[token.token_id],
            finish_reason=reasons.get(token.finish_reason or ""),
            # a stop string is the detokenizer's to find; a stop token id is the engine's
            stop_reason=token.stop_reason if token.finish_reason else None,
        )
        for req_id, token in tokens
    ]
    processor = engine.output_processor
    processed = processor.process_outputs(outputs)
    for req_id, token in tokens:  # the engine's own first output brings its prefill stats
        state = processor.request_states.get(req_id)  # (prompt tokens served from cache)
        if state is not None and not token.finish_reason:
            state.is_prefilling = True
    ended = [req_id for req_id, token in tokens if token.finish_reason]
    ended += [req_id for req_id in processed.reqs_to_abort if req_id not in ended]
    if ended:
        engine.engine_core.abort_requests(ended)
    return list(processed.request_outputs)
