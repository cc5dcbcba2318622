"""Shared pieces of the gateway fuzz tests (``test_gateway_fuzz``, ``test_gateway_fuzz_raw``).

The generation routes and a valid base body for each, the per-request timeout, the hypothesis
settings every fuzz run uses (``fuzz``: derandomized, no example database, no deadline), the
fake decode worker's reply (one chunk, whatever ``max_tokens`` says, so valid fuzz cases stay
cheap) and ``assert_still_serving``, each test's closing check that the gateway still answers
a valid request and has nothing left in flight.

Threading model: ``assert_still_serving`` runs on the test's event loop; the rest is pure.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

from hypothesis import HealthCheck, settings

from kvpush.schemas.messages import FinishReason, RequestEvent, TokenChunk, Usage
from kvpush.schemas.sampling import SequenceOutput, TokenLogprob
from tests.integration.gateway_fakes import Stack, sse_events, wait_until

StackFactory = Callable[..., Awaitable[Stack]]
Statuses = collections.Counter[tuple[str, int]]  # (case label or kind, HTTP status) -> count
TIMEOUT_S = 10.0  # per request: a hang fails the test instead of stalling it
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"prompt": "hello world", "max_tokens": 3},
    CHAT: {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
}


def fuzz(max_examples: int) -> settings:
    """Deterministic (derandomized, no example database), no deadline on a busy machine."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


def _candidates(k: int, chosen: int) -> list[TokenLogprob]:
    """``chosen`` first, then the top ``k`` (vLLM's shape: the sampled token plus the top k)."""
    top = [
        TokenLogprob(token_id=20 + i, logprob=-1.0 - i, rank=i + 1, decoded=f"t{i}")
        for i in range(k)
    ]
    return [TokenLogprob(token_id=chosen, logprob=-0.5, rank=1, decoded=" w0"), *top]


def one_chunk_reply(event: RequestEvent) -> list[TokenChunk]:
    """Whatever max_tokens says: one chunk " w0" per answer (``n``), finished, with the
    logprobs and prompt logprobs asked for, as a decode worker sends them (valid fuzz cases stay
    cheap)."""
    sampling = event.sampling
    k = sampling.logprobs
    outputs = [
        SequenceOutput(
            index=i,
            token_ids=[10],
            text=" w0",
            logprobs=None if k is None else [_candidates(max(k, 0), 10)],
            cumulative_logprob=None if k is None else -0.5,
            finish_reason="length",
        )
        for i in range(sampling.n)
    ]
    prompt_k = sampling.prompt_logprobs
    prompt_logprobs = None
    if prompt_k is not None:
        ids = event.prompt_token_ids
        prompt_logprobs = [None, *(_candidates(max(prompt_k, 0), t) for t in ids[1:])]
    usage = Usage(prompt_tokens=len(event.prompt_token_ids), completion_tokens=sampling.n)
    return [
        TokenChunk(
            event.request_id,
            event.transfer_id,
            seq=0,
            finish_reason=FinishReason.LENGTH,
            usage=usage,
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
        )
    ]


async def assert_still_serving(s: Stack) -> None:
    """A valid request (JSON and stream) answers correctly; nothing is left in flight."""
    await wait_until(lambda: s.gateway.in_flight == 0 and len(s.gateway.streams) == 0)
    published = len(s.decode.events)
    body = {"model": "kvpush-tiny", "prompt": "hello", "max_tokens": 1}
    status, answer = await s.post(COMPLETIONS, body)
    assert status == 200 and answer["choices"][0]["text"] == " w0", answer
    status, text = await s.post(CHAT, {**BASE[CHAT], "stream": True})
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in sse_events(text) if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == " w0", deltas
    assert len(s.decode.events) == published + 2
    assert s.gateway.in_flight == 0 and len(s.gateway.streams) == 0
    _, metrics = await s.call("GET", "/metrics")
    assert "kvpush_gateway_requests_in_flight 0.0" in metrics
    assert 'status="500"' not in metrics
