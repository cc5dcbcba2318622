"""The soak's judgement of one answer: token-exact, a client abort, an expected error, or a bug.

Pure functions and immutable records, no I/O (unit-tested on synthetic answers):

- ``parse_error_body`` accepts an HTTP error body only in the OpenAI shape
  (``{"error": {"message", "type", "param", "code"}}``, message and type non-empty strings);
  ``stream_error`` does the same for an ``{"error": ...}`` event inside a 200 SSE stream, whose
  status is implied by its type (``STREAM_ERROR_STATUS``).
- ``expected_errors(window, prefill, decode)`` lists, per window (a fault kind, or ``LOAD``
  while no fault is on), the errors the gateway answers by design while that fault plays out
  (status, type, code and message, read from ``gateway/bus_generation.py`` and
  ``http_server.py``). A worker killed or stopped whose role has **another worker** (``prefill``
  / ``decode``: the stack's workers per role) explains no error at all: the gateway moves its
  requests (``EXPECTED_REDUNDANT``). The only worker of its role explains 503 ``no_workers``
  and, for decode, 502 "decode worker ... was lost or restarted" (``EXPECTED``). A nats-server
  restart explains, whatever the workers, 503 "the message bus is unavailable" / "... was
  interrupted", 503 ``no_workers`` (leases run out while the server is down) and that 502, each
  within ``FAST_ERROR_S`` of the request being sent (the gateway fails such requests fast
  instead of waiting for their deadline: a 504 is no longer explained); a burst 429
  ``rate_limit_exceeded``. Anything else, and any error at all while no fault is on, is
  unexpected.
- ``judge`` compares a 200 with its reference by **token ids** (from the soak's own bus
  subscription to the gateway's TokenChunks: ``Observed``) and by text; an aborted stream's
  ids so far must be a prefix of the reference's. ``path_of`` names the way the answer was
  made: ``local`` (D computed the prompt: it proves nothing about KV), or
  ``<push|pull>/<received|cached|fallback>`` (the KV came from P; D's own prefix cache held the
  prompt and no KV was asked for; or D recomputed it), by the gateway's own rule (the final
  chunk's ``timing.kv_landed``, then ``timing.kv_cached``: ``gateway/observe.py``). A request
  the gateway moved to other workers (migration) is judged by its last transfer: that
  transfer's prompt is the original prompt plus the tokens the client was already sent, so the
  answer's ids are those extra prompt tokens followed by the last transfer's chunks
  (``Observed.answer_ids``).

Threading model: none (pure).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

LOAD: Final = "load"  # the window label while no fault is injected
# every fault kind the soak knows; a run plays the ones its --faults names
FAULTS: Final = (
    "kill_prefill", "kill_decode", "stop_prefill", "stop_decode", "restart_nats", "burst",
)  # fmt: skip
FAST_ERROR_S: Final = 15.0  # a nats-server restart's errors come this soon (the deadline: 60 s)

STREAM_ERROR_STATUS: Final[Mapping[str, int]] = MappingProxyType(
    {"worker_error": 502, "timeout": 504, "service_unavailable": 503}
)


class Delivery(str, enum.Enum):
    JSON = "json"  # stream=false
    STREAM = "stream"  # streamed and read to [DONE]
    ABORT = "abort"  # streamed; the client goes away after the first event


class Category(str, enum.Enum):
    OK = "ok"  # 200 and its token ids (and text) equal the reference's
    WRONG = "wrong"  # other token ids or text (an aborted stream: not a prefix)
    UNVERIFIED = "unverified"  # 200 with the right text, but its ids never reached the observer
    ABORTED = "aborted"  # the client dropped a streamed 200 after its first event
    EXPECTED_ERROR = "expected_error"
    UNEXPECTED = "unexpected"  # any other status, body, stream shape, reset or timeout


@dataclass(frozen=True)
class Reference:
    text: str
    token_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...] = ()  # the prompt's ids (): unknown, no request was moved


@dataclass(frozen=True)
class ErrorInfo:
    status: int  # HTTP status; for an error event inside a stream, the one its type implies
    type: str
    code: str | int | None
    message: str
    in_stream: bool = False

    def describe(self) -> str:
        where = " (in stream)" if self.in_stream else ""
        return f"{self.status} {self.type}{where}: {self.message[:80]}"


@dataclass(frozen=True)
class Expected:
    """An error the gateway answers by design: status, type, code and a message pattern."""

    status: int
    type: str
    code: str | None
    pattern: str  # a regular expression the message must match from its start
    within_s: float | None = None  # the answer came this soon after the request was sent

    def matches(self, error: ErrorInfo, elapsed_s: float = 0.0) -> bool:
        same = (error.status, error.type, error.code) == (self.status, self.type, self.code)
        soon = self.within_s is None or elapsed_s <= self.within_s
        return same and soon and re.match(self.pattern, error.message) is not None


_NO_PREFILL = Expected(503, "service_unavailable", "no_workers", r"no prefill worker is available$")
_NO_DECODE = Expected(503, "service_unavailable", "no_workers", r"no decode worker is available$")
_LOST = Expected(502, "worker_error", None, r"decode worker \S+ was lost or restarted$")
_OVERLOAD = Expected(429, "rate_limit_error", "rate_limit_exceeded", r"too many requests in flight")


def _fast(e: Expected) -> Expected:
    return Expected(e.status, e.type, e.code, e.pattern, FAST_ERROR_S)


# no heartbeats while the server is down (leases run out); requests in flight move or fail fast
_NATS: Final = tuple(
    _fast(e)
    for e in (
        Expected(503, "service_unavailable", None, r"the message bus is unavailable$"),
        Expected(503, "service_unavailable", None, r"the message bus was interrupted"),
        _NO_PREFILL,
        _NO_DECODE,
        _LOST,
    )
)
EXPECTED: Final[Mapping[str, tuple[Expected, ...]]] = MappingProxyType(
    {  # the victim is the only worker of its role
        LOAD: (),
        "kill_prefill": (_NO_PREFILL,),  # explicit push/pull while no prefill worker is alive
        "stop_prefill": (_NO_PREFILL,),
        "kill_decode": (_NO_DECODE, _LOST),
        "stop_decode": (_NO_DECODE, _LOST),
        "restart_nats": _NATS,
        "burst": (_OVERLOAD,),  # past the gateway's in-flight bound
    }
)
# the victim's role has another worker: the gateway moves what the victim held, no error
EXPECTED_REDUNDANT: Final[Mapping[str, tuple[Expected, ...]]] = MappingProxyType(
    {
        **EXPECTED,
        **dict.fromkeys(("kill_prefill", "stop_prefill", "kill_decode", "stop_decode"), ()),
    }
)


def role_of_fault(kind: str) -> str | None:
    """``prefill`` / ``decode`` for a fault that kills or stops a worker of that role."""
    head, _, role = kind.partition("_")
    return role if head in ("kill", "stop") and role in ("prefill", "decode") else None


def expected_errors(window: str, prefill: int = 1, decode: int = 1) -> tuple[Expected, ...]:
    """The errors ``window`` explains on a stack of ``prefill`` + ``decode`` workers."""
    role = role_of_fault(window)
    spare = role is not None and (prefill if role == "prefill" else decode) >= 2
    return (EXPECTED_REDUNDANT if spare else EXPECTED).get(window, ())


@dataclass(frozen=True)
class Answer:
    """What the HTTP client got, before any check."""

    delivery: Delivery
    status: int  # 0: no HTTP status (connection failed)
    request_id: str = ""  # X-Request-Id, "" when the gateway gave none
    text: str = ""  # the whole text (json, stream) or the first event's (abort)
    error: ErrorInfo | None = None
    problem: str = ""  # why the answer is malformed; "" when it is well formed
    elapsed_s: float = 0.0  # from sending the request to its answer (or error event)


@dataclass(frozen=True)
class Observed:
    """One request's last transfer (its only one unless the gateway moved it) as the soak's own
    bus subscriber saw it: its RequestEvent and its TokenChunks."""

    token_ids: tuple[int, ...]  # the chunks from seq 0 without a gap
    complete: bool  # the final chunk and every one before it arrived (and the RequestEvent)
    mode: str | None  # the RequestEvent's mode (what the gateway routed); None: not seen
    kv_landed: bool  # the final chunk's timing: the KV came from the prefill worker
    prompt_ids: tuple[int, ...] = ()  # the RequestEvent's prompt (); not seen
    moves: int = 0  # transfers before this one: the gateway moved the request this often
    kv_cached: bool = False  # the final chunk's timing: D's prefix cache held the prompt

    def answer_ids(self, prompt: tuple[int, ...]) -> tuple[int, ...] | None:
        """The answer's ids given the original ``prompt``: the tokens a move put after it in
        this transfer's prompt, then this transfer's chunks; None: the prompt is not the
        original's continued (``prompt`` () or no prompt seen: the chunks alone)."""
        if not prompt or not self.prompt_ids:
            return self.token_ids
        if self.prompt_ids[: len(prompt)] != prompt:
            return None
        return self.prompt_ids[len(prompt) :] + self.token_ids


@dataclass(frozen=True)
class Judgement:
    category: Category
    path: str  # see ``path_of``
    detail: str = ""  # for errors and failures: what went wrong (grouping key)


def path_of(observed: Observed | None) -> str:
    """``local``, ``push/received``, ``push/cached``, ``push/fallback``, ``pull/...``, or
    ``unknown``."""
    if observed is None or observed.mode is None:
        return "unknown"
    if observed.mode == "local":
        return "local"
    if observed.kv_landed:
        return f"{observed.mode}/received"
    return f"{observed.mode}/{'cached' if observed.kv_cached else 'fallback'}"


def _error_fields(body: Any) -> tuple[str, str, str | int | None] | str:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return "not an OpenAI error body (no 'error' object)"
    error = body["error"]
    missing = [k for k in ("message", "type", "param", "code") if k not in error]
    if missing:
        return f"OpenAI error body without {', '.join(missing)}"
    message, type_, code = error["message"], error["type"], error["code"]
    if not isinstance(message, str) or not message or not isinstance(type_, str) or not type_:
        return "OpenAI error body with an empty or non-string message/type"
    if code is not None and not isinstance(code, (str, int)):
        return "OpenAI error body with a code that is not a string or integer"
    return message, type_, code


def parse_error_body(status: int, body: Any) -> ErrorInfo | str:
    """The error of a non-200 answer, or why its body is not an OpenAI error body."""
    fields = _error_fields(body)
    if isinstance(fields, str):
        return f"{status}: {fields}"
    message, type_, code = fields
    return ErrorInfo(status, type_, code, message)


def stream_error(event: Any) -> ErrorInfo | str | None:
    """An SSE event's error (None: the event is no error), or why it is malformed."""
    if not isinstance(event, dict) or "error" not in event:
        return None
    fields = _error_fields(event)
    if isinstance(fields, str):
        return f"stream error event: {fields}"
    message, type_, code = fields
    status = STREAM_ERROR_STATUS.get(type_)
    if status is None:
        return f"stream error event of unknown type {type_!r}"
    return ErrorInfo(status, type_, code, message, in_stream=True)


def expected(
    window: str, error: ErrorInfo, elapsed_s: float = 0.0, prefill: int = 1, decode: int = 1
) -> bool:
    return any(e.matches(error, elapsed_s) for e in expected_errors(window, prefill, decode))


def _is_prefix(part: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    return whole[: len(part)] == part


def _late(answer: Answer) -> str:
    return f" (after {answer.elapsed_s:.0f} s)" if answer.elapsed_s > FAST_ERROR_S else ""


def judge(
    answer: Answer,
    reference: Reference,
    observed: Observed | None,
    window: str,
    *,
    prefill: int = 1,
    decode: int = 1,
) -> Judgement:
    """The category of one answer on a stack of ``prefill`` + ``decode`` workers; see the
    module docstring."""
    path = path_of(observed)
    if answer.problem:
        return Judgement(Category.UNEXPECTED, path, answer.problem)
    if answer.error is not None:
        error = answer.error
        fits = expected(window, error, answer.elapsed_s, prefill, decode)
        category = Category.EXPECTED_ERROR if fits else Category.UNEXPECTED
        return Judgement(category, path, error.describe() + ("" if fits else _late(answer)))
    if answer.status != 200:
        return Judgement(Category.UNEXPECTED, path, f"{answer.status} without an error body")
    ids = observed.answer_ids(reference.prompt_ids) if observed is not None else ()
    if ids is None:
        return Judgement(Category.WRONG, path, "a moved request's prompt is not the original")
    if answer.delivery is Delivery.ABORT:
        if observed is not None and not _is_prefix(ids, reference.token_ids):
            return Judgement(Category.WRONG, path, "aborted stream: ids not a reference prefix")
        if not reference.text.startswith(answer.text):
            return Judgement(Category.WRONG, path, "aborted stream: text not a reference prefix")
        return Judgement(Category.ABORTED, path)
    if observed is not None and (
        ids != reference.token_ids
        if observed.complete
        else not _is_prefix(ids, reference.token_ids)
    ):
        return Judgement(Category.WRONG, path, "token ids differ from the reference")
    if answer.text != reference.text:
        return Judgement(Category.WRONG, path, "text differs from the reference")
    if observed is None or not observed.complete:
        return Judgement(Category.UNVERIFIED, path, "token chunks not all seen on the bus")
    return Judgement(Category.OK, path)
