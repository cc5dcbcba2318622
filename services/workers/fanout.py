"""A request's ``n`` answers in an ``EngineHost``: ``engine_params`` (a ``SamplingSpec`` as the
``SamplingParams`` of one answer) and ``Answers`` (the bookkeeping of one request's answers).

vLLM fans a request with ``n`` > 1 out itself (``ParentRequest``), but every child would carry
the request's ``kv_transfer_params``: n receives of one transfer. The host fans out instead, as
``ParentRequest`` does (child i: ``n`` = 1, ``seed + i`` when seeded): answer 0 is the request as
it comes (the KV transfer, engine request id = the request id), answers 1..n-1 go to the engine
without transfer parameters once answer 0's first output came, so its prompt KV is in the
prefix cache and they hit it (with prefix caching off they recompute it: still one engine's
answers). Their engine request ids are ``f"{request_id}.{i}"`` ('.' is outside the transfer-id
alphabet: no other request's id can be one of them). Every answer's deltas go to the request's
one ``RequestHandle``, with their index; the request ends when every answer ended.

Also ``AnswersHost``, what both hosts share (the answers by id, ``submit`` and ``abort``).

Threading model: the host's thread or loop only (``EngineHost``'s engine thread,
``CoreEngineHost``'s client loop), but for ``submit``/``abort``/``_await_ready``, which any
thread may call; ``engine_params`` imports vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.workers.handles import EngineOutput, RequestHandle

log = logging.getLogger(__name__)
FAILED = ("error", "abort")  # an answer 0 ending so before the others started: none start


def child_id(request_id: str, index: int) -> str:
    """The engine request id of answer ``index`` (answer 0: the request's own)."""
    return request_id if index == 0 else f"{request_id}.{index}"


def engine_params(
    spec: SamplingSpec, index: int = 0, kv_params: dict[str, Any] | None = None
) -> Any:
    """vLLM ``SamplingParams`` of answer ``index`` of ``spec`` (``n`` = 1, the seed shifted by
    the index, the prompt's log-probabilities for answer 0 only), DELTA outputs, and the
    connector's ``kv_transfer_params`` (answer 0 only). Kwargs vLLM 0.26 and 0.32 both take."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    fields = msgspec.structs.asdict(spec)  # SamplingSpec's fields are SamplingParams' names
    fields = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}  # own copies
    fields["n"] = 1
    if spec.seed is not None:
        fields["seed"] = spec.seed + index
    if index > 0:
        fields["prompt_logprobs"] = None
    if spec.logit_bias is not None:
        fields["logit_bias"] = {int(t): float(b) for t, b in spec.logit_bias.items()}
    if spec.structured_outputs is not None:
        from vllm.sampling_params import StructuredOutputsParams

        known = {f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init}
        # json: the schema as text (vLLM takes str or dict); a field this vLLM's
        # StructuredOutputsParams lacks is left out (the gateway's vLLM may be another)
        grammar = msgspec.structs.asdict(spec.structured_outputs)
        grammar = {k: list(v) if isinstance(v, list) else v for k, v in grammar.items()}
        grammar = {k: v for k, v in grammar.items() if k in known}
        fields["structured_outputs"] = StructuredOutputsParams(**grammar)
    return SamplingParams(
        **fields,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_params} if kv_params and index == 0 else None,
    )


@dataclasses.dataclass
class Answers:
    """One request's answers: which are in the engine (``live``: engine request id -> index),
    which wait for answer 0's first output (``later``: (index, params)), and what the
    request's last output carries (answer 0's cached-token count and transfer parameters, the
    first answer's error)."""

    request_id: str
    handle: RequestHandle
    prompt: tuple[list[int], str | None]  # token ids and cache salt, for the later answers
    live: dict[str, int]
    later: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    num_cached_tokens: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None  # an answer ended "error": the request's end is "error" too

    @property
    def ended(self) -> bool:
        return not self.live and not self.later

    def take(self, engine_id: str, delta: EngineOutput) -> EngineOutput:
        """Record a delta of the answer ``engine_id`` (from ``delta_of``: ``finish_reason`` is
        the answer's); return it as the request's: its id, ``finish_reason`` only when it
        ends it."""
        if delta.request_id != self.request_id:
            delta = dataclasses.replace(delta, request_id=self.request_id)
        if delta.index == 0:
            if delta.num_cached_tokens is not None:
                self.num_cached_tokens = delta.num_cached_tokens
            if delta.kv_transfer_params is not None:
                self.kv_transfer_params = delta.kv_transfer_params
        if delta.sequence_finish_reason is None:
            return delta
        self.live.pop(engine_id, None)
        if delta.sequence_finish_reason in FAILED and delta.index == 0:
            self.later.clear()  # answer 0 never got going: the request ends with it
        if delta.sequence_finish_reason == "error" and self.error is None:
            self.error = delta.error or "the engine failed this request"
        if not self.ended:
            return dataclasses.replace(delta, finish_reason=None, error=None)
        return self.last(delta)

    def last(self, delta: EngineOutput) -> EngineOutput:
        """``delta`` as the request's last output: its end (the last answer's, "error" when
        any answer failed), answer 0's cached tokens and transfer parameters."""
        return dataclasses.replace(
            delta,
            finish_reason="error" if self.error else delta.finish_reason,
            error=self.error or delta.error,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
        )

    def end(self, reason: str, error: str | None) -> tuple[list[str], EngineOutput]:
        """End every answer now: the engine request ids still live (the host aborts them) and
        the request's last output (answer 0's transfer parameters, if it ended already)."""
        live = list(self.live)
        self.live.clear()
        self.later.clear()
        last = EngineOutput(
            self.request_id,
            [],
            "",
            reason,
            error,
            self.kv_transfer_params,
            self.num_cached_tokens,
        )
        return live, last

    def start_later(self, add: Any) -> EngineOutput | None:
        """Hand the later answers to the engine (``add(engine_id, params)``); an answer the
        engine refuses ends "error" at once. Returns the request's last output when that ended
        it (every other answer ended already), else None."""
        later, self.later = self.later, []
        for index, params in later:
            engine_id = child_id(self.request_id, index)
            try:
                add(engine_id, params)
            except Exception as exc:
                self.error = self.error or f"answer {index} rejected: {exc}"
                continue
            self.live[engine_id] = index
        if self.ended:
            return self.last(EngineOutput(self.request_id, [], "", "error"))
        return None


class AnswersHost:
    """What both engine hosts share (``EngineHost``, ``CoreEngineHost``): every request's
    ``Answers`` by request id and by the engine request id of each answer, touched on the
    host's own thread or loop only, and ``submit``/``abort``, which hand their work there
    (``_dispatch``); the waiting for the engine's build."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._requests: dict[str, Answers] = {}  # host thread or loop only: by request id
        self._answers: dict[str, Answers] = {}  # ... and by the engine request id of each answer
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    def _dispatch(self, command: Callable[[], Any]) -> Any:
        """Run ``command`` on the host's thread or loop soon; RuntimeError when not running."""
        raise NotImplementedError

    def _add(self, handle: RequestHandle, request: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str, reason: str, error: str | None) -> None:
        raise NotImplementedError

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> RequestHandle:
        """Hand a request to the engine; its outputs (or its error, as a final output) arrive on
        the handle."""
        handle = RequestHandle(request_id)
        request = (list(prompt_token_ids), cache_salt, sampling, kv_transfer_params)
        self._dispatch(lambda: self._add(handle, request))
        return handle

    def abort(self, request_id: str) -> None:
        """End a request now; its handle gets a final output with finish_reason "abort"."""
        self._dispatch(lambda: self._abort(request_id, "abort", None))

    def _taken(self, engine_id: str) -> bool:
        return engine_id in self._answers or engine_id in self._requests

    def _await_ready(self, timeout: float) -> None:
        """Wait for the engine's build (gated, ``wait_for_gate``: the opener, kvpush up,
        bounds the start, the wait included); raise its error."""
        if not self._ready.wait(None if self.config.start_gate else timeout):
            raise TimeoutError(f"engine not ready after {timeout} s")
        if self._start_error is not None:
            raise RuntimeError(f"engine build failed: {self._start_error!r}") from self._start_error

    def _deliver(self, answers: Answers, engine_id: str, delta: EngineOutput) -> None:
        """One delta of answer ``engine_id`` to its request's handle; answer 0's first output
        starts the later answers (its prompt KV is in the prefix cache now)."""
        answers.handle._push(answers.take(engine_id, delta))
        if answers.later and delta.index == 0:
            # only while later answers wait (n > 1): no per-token allocation otherwise
            last = answers.start_later(functools.partial(self._add_answer, answers))
            if last is not None:
                answers.handle._push(last)
        if answers.handle.finished_at is not None:
            self._requests.pop(answers.request_id, None)

    def _add_answer(self, answers: Answers, engine_id: str, params: Any) -> None:
        raise NotImplementedError


def open_request(
    handle: RequestHandle, request: tuple[Any, ...], taken: Any
) -> tuple[Answers, Any] | None:
    """A new request's ``Answers`` and answer 0's ``SamplingParams``; ``request`` is (prompt
    token ids, cache salt, ``SamplingSpec``, transfer parameters), ``taken(engine_id)`` says an
    engine request id is in use. None once the handle got the refusal (a duplicate id,
    parameters vLLM refuses)."""
    token_ids, cache_salt, sampling, kv_params = request
    rid = handle.request_id
    try:
        if any(taken(child_id(rid, i)) for i in range(sampling.n)):
            raise ValueError("duplicate request_id")
        params = [engine_params(sampling, i, kv_params) for i in range(sampling.n)]
    except Exception as exc:
        refuse(handle, exc)
        return None
    later = list(enumerate(params))[1:]
    return Answers(rid, handle, (token_ids, cache_salt), {rid: 0}, later), params[0]


def refuse(handle: RequestHandle, exc: Exception) -> None:
    """End a request the engine did not take: one final "error" output."""
    log.warning("request %s rejected: %s", handle.request_id, exc)
    handle._push(EngineOutput(handle.request_id, [], "", "error", f"rejected: {exc}"))
