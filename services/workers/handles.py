"""The outputs of the requests an ``EngineHost`` runs: ``EngineOutput`` (one delta, or a whole
result) and ``RequestHandle`` (every delta of one request, for blocking and asyncio readers), and
``delta_of`` (a vLLM ``RequestOutput`` as an ``EngineOutput``).

Threading model: the engine thread pushes into a handle (``_push``); any thread reads it
(``iter``, ``result``) and asyncio readers get deltas through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    """One delta of a request (``finish_reason`` set on the last), or a whole ``result()``."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    logprobs: list[dict[int, float]] | None = None  # per token: top ids -> log-probability
    stop_reason: int | str | None = None  # finish "stop": the stop token id or string, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestHandle:
    """The outputs of one request (at most ``max_tokens + 1`` deltas) for blocking readers
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

    def result(self, timeout: float | None = None) -> EngineOutput:
        """Wait for the final output (TimeoutError after ``timeout`` s); all deltas joined."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finished_at is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            outs = self._outputs
            return dataclasses.replace(
                outs[-1],
                token_ids=[t for o in outs for t in o.token_ids],
                text="".join(o.text for o in outs),
                num_cached_tokens=outs[0].num_cached_tokens,
                logprobs=None
                if all(o.logprobs is None for o in outs)
                else [pos for o in outs for pos in o.logprobs or []],
            )


def delta_of(out: Any) -> EngineOutput:
    """A vLLM ``RequestOutput`` (DELTA kind) as an ``EngineOutput``."""
    c = out.outputs[0]
    reason = str(c.finish_reason or "stop") if out.finished else None
    error = "the engine failed this request" if reason == "error" else None
    kv, cached = out.kv_transfer_params, out.num_cached_tokens
    top = None
    if c.logprobs is not None:  # asked for (SamplingSpec.logprobs): one dict per new token
        top = [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in c.logprobs]
    stop = c.stop_reason if reason == "stop" else None
    return EngineOutput(
        out.request_id, list(c.token_ids), c.text, reason, error, kv, cached, top, stop
    )
