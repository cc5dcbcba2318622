"""The outputs of the requests an ``EngineHost`` runs: ``EngineOutput`` (one delta of one of a
request's answers, or a whole result) and ``RequestHandle`` (every delta of one request, for
blocking and asyncio readers); the conversions ``delta_of`` (a vLLM ``RequestOutput`` as an
``EngineOutput``, its log-probabilities as ``TokenLogprob``s, never below ``LOGPROB_FLOOR``) and
``sequence_output`` (an ``EngineOutput`` as the bus's ``SequenceOutput``).

Threading model: the engine thread pushes into a handle (``_push``); any thread reads it
(``iter``, ``result``) and asyncio readers get deltas through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Final

from kvpush.schemas.sampling import SequenceOutput, TokenLogprob

LOGPROB_FLOOR: Final = -9999.0  # JSON has no -inf; vLLM's OpenAI server prints this floor
MAX_DECODED: Final = 4096  # TokenLogprob.decoded's bound
MAX_STOP_STRING: Final = 256  # SequenceOutput.stop_reason's bound


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    """One delta of answer ``index`` of a request (``finish_reason`` set on the request's last
    output only), or a whole ``result()``. With ``n`` > 1 an answer may end before the request
    does: its last delta has ``sequence_finish_reason`` set and ``finish_reason`` None."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    # per new token: the sampled token first, then the top ones (vLLM's order), when asked for
    logprobs: list[list[TokenLogprob]] | None = None
    stop_reason: int | str | None = None  # answer ended "stop": the stop token id or string
    index: int = 0  # which of the request's n answers
    cumulative_logprob: float | None = None  # the answer's so far, when logprobs were asked for
    # the request's first output only, when asked for: one entry per prompt token (first None)
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    sequence_finish_reason: str | None = None  # this answer's end (its last delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle:
    """The outputs of one request (at most ``n * (max_tokens + 1)`` deltas) for blocking readers
    (``iter``, ``result``) and asyncio (``async for``, fed by ``loop.call_soon_threadsafe``);
    ``submitted_at``, ``first_output_at``, ``finished_at`` are ``time.monotonic()`` stamps.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.submitted_at = time.monotonic()
        self.first_output_at: float | None = None
        self.finished_at: float | None = None
        self._cond = threading.Condition()
        self._outputs: list[EngineOutput] = []
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[EngineOutput]]] = []

    def _push(self, output: EngineOutput) -> None:
        """Engine thread only; anything after the final output is dropped."""
        with self._cond:
            if self.finished_at is not None:
                return
            now = time.monotonic()
            self.first_output_at = self.first_output_at or now
            self.finished_at = now if output.finished else None
            self._outputs.append(output)
            self._cond.notify_all()
            for loop, q in self._listeners:
                with contextlib.suppress(RuntimeError):  # a closed loop: its reader is gone
                    loop.call_soon_threadsafe(q.put_nowait, output)

    def __iter__(self) -> Iterator[EngineOutput]:
        """Blocking iteration over the deltas, ending after the final one."""
        for seen in itertools.count():
            with self._cond:
                self._cond.wait_for(lambda n=seen: len(self._outputs) > n)
                output = self._outputs[seen]
            yield output
            if output.finished:
                return

    async def __aiter__(self) -> AsyncIterator[EngineOutput]:
        """``async for output in handle``: deltas delivered on the running loop."""
        listener = (asyncio.get_running_loop(), asyncio.Queue[EngineOutput]())
        with self._cond:
            for output in self._outputs:
                listener[1].put_nowait(output)
            self._listeners.append(listener)
        try:
            while not (output := await listener[1].get()).finished:
                yield output
            yield output
        finally:
            with self._cond, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

    def result(self, timeout: float | None = None, index: int = 0) -> EngineOutput:
        """Wait for the final output (TimeoutError after ``timeout`` s): answer ``index``'s
        deltas joined, the request's end."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished_at is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            outs = [o for o in self._outputs if o.index == index]
            ended = [o for o in outs if o.sequence_finish_reason is not None]
            return dataclasses.replace(
                self._outputs[-1],
                token_ids=[t for o in outs for t in o.token_ids],
                text="".join(o.text for o in outs),
                num_cached_tokens=self._outputs[0].num_cached_tokens,
                logprobs=None
                if all(o.logprobs is None for o in outs)
                else [pos for o in outs for pos in o.logprobs or []],
                index=index,
                stop_reason=ended[-1].stop_reason if ended else None,
                cumulative_logprob=outs[-1].cumulative_logprob if outs else None,
                prompt_logprobs=self._outputs[0].prompt_logprobs,
                sequence_finish_reason=ended[-1].sequence_finish_reason if ended else None,
            )


def _floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and nan too


def position_logprobs(position: Any) -> list[TokenLogprob]:
    """One position's candidates (vLLM: token id -> ``Logprob``) in vLLM's order."""
    return [
        TokenLogprob(
            int(token_id),
            _floor(float(lp.logprob)),
            lp.rank,
            None if lp.decoded_token is None else str(lp.decoded_token)[:MAX_DECODED],
        )
        for token_id, lp in position.items()
    ]


def logprobs_of(positions: Iterable[Any] | None) -> list[list[TokenLogprob]] | None:
    """vLLM's sample log-probabilities (a list of dicts, or ``FlatLogprobs``: both iterate
    positions, each a token id -> ``Logprob`` mapping)."""
    return None if positions is None else [position_logprobs(pos) for pos in positions]


def prompt_logprobs_of(positions: Iterable[Any] | None) -> list[list[TokenLogprob] | None] | None:
    """vLLM's prompt log-probabilities: position 0 (no context) is None (``FlatLogprobs`` holds
    it as an empty position); none (vLLM's DELTA outputs after the first: empty) is None."""
    if not positions:
        return None
    return [position_logprobs(pos) if pos else None for pos in positions]


def _cumulative(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return max(float(value), LOGPROB_FLOOR) if math.isinf(value) else float(value)


def delta_of(out: Any, index: int = 0) -> EngineOutput:
    """A vLLM ``RequestOutput`` (DELTA kind, one answer: n = 1) as an ``EngineOutput`` of answer
    ``index``; ``finish_reason`` is the answer's (the host's fan-out makes it the request's)."""
    c = out.outputs[0]
    reason = str(c.finish_reason or "stop") if out.finished else None
    error = "the engine failed this request" if reason == "error" else None
    stop = c.stop_reason if reason == "stop" else None
    return EngineOutput(
        out.request_id,
        list(c.token_ids),
        c.text,
        reason,
        error,
        out.kv_transfer_params,
        out.num_cached_tokens,
        logprobs_of(c.logprobs),
        stop,
        index,
        _cumulative(getattr(c, "cumulative_logprob", None)),
        prompt_logprobs_of(getattr(out, "prompt_logprobs", None)),
        reason,
    )


def sequence_output(out: EngineOutput) -> SequenceOutput:
    """An answer's delta as the bus carries it (``TokenChunk.outputs``)."""
    stop = out.stop_reason if out.sequence_finish_reason == "stop" else None
    return SequenceOutput(
        index=out.index,
        token_ids=out.token_ids,
        text=out.text,
        logprobs=out.logprobs,
        cumulative_logprob=out.cumulative_logprob,
        finish_reason=out.sequence_finish_reason,
        stop_reason=stop[:MAX_STOP_STRING] if isinstance(stop, str) else stop,
    )
