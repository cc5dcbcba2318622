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

Also ``AnswersHost``, what both hosts share (the start, the answers by id, ``submit``,
``abort`` and the routing of outputs).

Threading model: the host's thread or loop only (``EngineHost``'s engine thread,
``CoreEngineHost``'s client loop), but for ``start``/``submit``/``abort``, which any thread may
call; ``engine_params`` imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.workers.engine_config import EngineConfig, engine_env
from kvpush.services.workers.handles import EngineOutput, RequestHandle, delta_of

log = logging.getLogger(__name__)
FAILED = ("error", "abort")  # an answer 0 ending so before the others started: none start


def child_id(request_id: str, index: int) -> str:
    """The engine request id of answer ``index`` (answer 0: the request's own)."""
    return request_id if index == 0 else f"{request_id}.{index}"


def engine_params(
    spec: SamplingSpec,
    index: int = 0,
    kv_params: dict[str, Any] | None = None,
    report_hits: bool = False,
) -> Any:
    """vLLM ``SamplingParams`` of answer ``index`` of ``spec`` (``n`` = 1, the seed shifted by
    the index, the prompt's log-probabilities for answer 0 only), DELTA outputs, the
    connector's ``kv_transfer_params`` (answer 0 only) and with ``report_hits`` vLLM's "full"
    KV cache report mode (its prefix-cache hits become KV events too: ``cache_events``; the
    sampling is the same). Kwargs vLLM 0.26 and 0.32 both take."""
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
        given = msgspec.structs.asdict(spec.structured_outputs).items()
        grammar = {k: list(v) if isinstance(v, list) else v for k, v in given if k in known}
        fields["structured_outputs"] = StructuredOutputsParams(**grammar)
    extra_args: dict[str, Any] = {}
    if kv_params and index == 0:
        extra_args["kv_transfer_params"] = kv_params
    if report_hits:
        extra_args["kv_cache_report_mode"] = "full"
    return SamplingParams(
        **fields, output_kind=RequestOutputKind.DELTA, extra_args=extra_args or None
    )


@dataclasses.dataclass
class Answers:
    """One request's answers: which are in the engine (``live``: engine request id -> index),
    which wait for answer 0's first output (``later``: (index, params)), and what the
    request's last output carries (answer 0's cached-token count and transfer parameters, the
    first answer's error)."""

    request_id: str
    handle: RequestHandle
    prompt: Any  # vLLM's (``tokens_input``: token ids and cache salt), for every answer
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
    """What both engine hosts share (``EngineHost``, ``CoreEngineHost``): the start (the
    engine's environment, its build on the host's thread ``_run``), every request's ``Answers``
    by request id and by the engine request id of each answer, touched on the host's own thread
    or loop only, and ``submit``/``abort``, which hand their work there (``_dispatch``)."""

    thread_name = "kvpush-engine"
    daemon = False
    start_timeout_s = 600.0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.steps = 0  # engine steps run, and how many of them were idle
        self.idle_steps = 0
        self.last_free_blocks = 0  # the pool's free blocks after the last step
        self._num_blocks = 0  # the KV pool's, once built
        self._thread: threading.Thread | None = None
        self._engine: Any = None  # the host's thread or loop only
        self._accepting = False
        self._requests: dict[str, Answers] = {}  # host thread or loop only: by request id
        self._answers: dict[str, Answers] = {}  # ... and by the engine request id of each answer
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    def start(
        self, progress: Callable[[str], None] | None = None, timeout: float | None = None
    ) -> None:
        """Build the engine on the host's thread (``progress`` gets a line per stage); return
        when ready, or raise its error. Gated (``wait_for_gate``), the start waits without a
        bound: the opener, kvpush up, bounds it, the wait included."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        env = engine_env(self.config, os.environ)
        self._pin(env)
        os.environ.update(env)  # before vllm is imported: it reads some of these at import
        report = progress or (lambda _msg: None)
        self._thread = threading.Thread(
            target=self._run, args=(report,), name=self.thread_name, daemon=self.daemon
        )
        self._thread.start()
        timeout = timeout or self.start_timeout_s
        if not self._ready.wait(None if self.config.start_gate else timeout):
            raise TimeoutError(f"engine not ready after {timeout} s")
        if self._start_error is not None:
            raise RuntimeError(f"engine build failed: {self._start_error!r}") from self._start_error

    def total_blocks(self) -> int:
        """Usable blocks of the KV pool (vLLM's reserved null block excluded)."""
        return max(0, self._num_blocks - 1)

    def _pin(self, env: dict[str, str]) -> None:
        """Pin the engine to ``cpu_cores``: this thread, whose threads (the host's, and the
        engine-core process it starts) inherit the affinity."""
        if self.config.cpu_cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.config.cpu_cores)

    def _run(self, report: Callable[[str], None]) -> None:
        raise NotImplementedError

    def _built(self, build: Callable[[], Any]) -> bool:
        """Run the engine's build on the host's thread; False when it failed (``start``
        raises its error)."""
        try:
            build()
            self._accepting = True
        except BaseException as exc:
            self._start_error = exc
        finally:
            self._ready.set()
        return self._accepting

    def _dispatch(self, command: Callable[[], Any]) -> Any:
        """Run ``command`` on the host's thread or loop soon; RuntimeError when not running."""
        raise NotImplementedError

    def _add_answer(self, answers: Answers, engine_id: str, params: Any) -> None:
        """Hand one answer to the engine (its outputs then reach ``_route``)."""
        raise NotImplementedError

    def _abort_answers(self, engine_ids: list[str]) -> None:
        """End these answers in the engine."""
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
        prompt = list(prompt_token_ids)
        self._dispatch(lambda: self._add(handle, prompt, cache_salt, sampling, kv_transfer_params))
        return handle

    def abort(self, request_id: str) -> None:
        """End a request now; its handle gets a final output with finish_reason "abort"."""
        self._dispatch(lambda: self._abort(request_id, "abort", None))

    def _add(
        self,
        handle: RequestHandle,
        token_ids: list[int],
        cache_salt: str | None,
        sampling: SamplingSpec,
        kv_params: dict[str, Any] | None,
    ) -> None:
        """Answer 0 to the engine, the later ones kept in the request's ``Answers``. A request
        refused (a duplicate id, parameters vLLM refuses) ends with one "error" output."""
        from vllm.inputs.engine import tokens_input

        rid = handle.request_id
        try:
            ids = [child_id(rid, i) for i in range(sampling.n)]
            if any(i in self._answers or i in self._requests for i in ids):
                raise ValueError("duplicate request_id")
            hits = bool(self.config.kv_events_endpoint)  # --kv-events on: report reuse too
            params = [engine_params(sampling, i, kv_params, hits) for i in range(sampling.n)]
            prompt = tokens_input(token_ids, cache_salt=cache_salt)
            answers = Answers(rid, handle, prompt, {rid: 0}, list(enumerate(params))[1:])
            self._add_answer(answers, rid, params[0])
        except Exception as exc:
            log.warning("request %s rejected: %s", rid, exc)
            handle._push(EngineOutput(rid, [], "", "error", f"rejected: {exc}"))
            return
        self._requests[rid] = answers

    def _abort(self, request_id: str, reason: str, error: str | None) -> None:
        """End a request and every answer of it in the engine."""
        if (answers := self._requests.pop(request_id, None)) is None:
            return
        live, last = answers.end(reason, error)
        for engine_id in live:
            self._answers.pop(engine_id, None)
        try:
            if live:
                self._abort_answers(live)
        finally:
            answers.handle._push(last)

    def _abort_all(self, reason: str, error: str) -> None:
        for request_id in sorted(self._requests):
            with contextlib.suppress(Exception):
                self._abort(request_id, reason, error)

    def _route(self, out: Any) -> None:
        """One answer's ``RequestOutput`` to its request's handle; answer 0's first output
        starts the later answers (its prompt KV is in the prefix cache now)."""
        if (answers := self._answers.get(out.request_id)) is None:  # aborted meanwhile
            return
        delta = delta_of(out, answers.live[out.request_id])
        if out.finished:
            del self._answers[out.request_id]
        self._deliver(answers, out.request_id, delta)

    def _deliver(self, answers: Answers, engine_id: str, delta: EngineOutput) -> None:
        answers.handle._push(answers.take(engine_id, delta))
        if answers.later and delta.index == 0:
            # only while later answers wait (n > 1): no per-token allocation otherwise
            last = answers.start_later(functools.partial(self._add_answer, answers))
            if last is not None:
                answers.handle._push(last)
        if answers.handle.finished_at is not None:
            self._requests.pop(answers.request_id, None)
