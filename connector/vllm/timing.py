"""Critical-path timing of the connector: its spans and the per-process marks table.

Spans: the connector's halves run on vLLM's threads, not inside the worker's span, so each span
is made after the fact with explicit start/end instants (unix ns) and the request's parent
context from ``TransferParams.traceparent`` (the worker's ``bus.receive`` span of the
RequestEvent). With no SDK tracer provider installed ``emit`` returns at once: tracing off costs
one ``isinstance`` check.

Marks: ``record(transfer_id, **instants)`` keeps what this process learned of a transfer's
critical path (``Timing`` fields: D's ``kv_landed``, P's ``prefill_start``/``prefill_end``/
``kv_sent`` from KvPushed or KvReady) so the decode worker can put them on the request's last
TokenChunk (``take``). The table is bounded (oldest dropped first); in a multiprocess engine
it lives in the engine process and the worker simply finds nothing.

Threading model: any thread; the marks table takes a lock, ``emit`` is thread-safe (OTel SDK).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.trace import StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.schemas.messages import Timing

MAX_MARKS = 8192
_tracer = trace.get_tracer("kvpush.connector")
_propagator = TraceContextTextMapPropagator()
_enabled = False
_lock = threading.Lock()
_marks: OrderedDict[str, dict[str, int]] = OrderedDict()

Attributes = Mapping[str, str | int | float | bool]


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(instant: float, now: float | None = None) -> int:
    """Unix ns of a ``time.monotonic()`` instant (for transport timestamps)."""
    now = time.monotonic() if now is None else now
    return time.time_ns() - int((now - instant) * 1e9)


def enabled() -> bool:
    global _enabled
    if not _enabled:
        _enabled = isinstance(trace.get_tracer_provider(), SdkTracerProvider)
    return _enabled


def parent(traceparent: str | None) -> Context | None:
    """The request's trace context (None when tracing is off or there is none)."""
    if not traceparent or not enabled():
        return None
    return _propagator.extract({"traceparent": traceparent})


def emit(
    name: str,
    traceparent: str | None,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
    events: Sequence[tuple[str, int, Attributes]] = (),
    error: str | None = None,
) -> None:
    """One finished span ``name`` under the request's trace (nothing when tracing is off)."""
    if not enabled() or not start_ns:
        return
    span = _tracer.start_span(
        name, context=parent(traceparent), start_time=start_ns, attributes=attributes
    )
    for event_name, at_ns, event_attributes in events:
        span.add_event(event_name, event_attributes, timestamp=at_ns)
    if error:
        span.set_status(StatusCode.ERROR, error)
    span.end(end_time=max(end_ns, start_ns))


def record(transfer_id: str, **instants: int) -> None:
    """Remember ``Timing`` instants of a transfer (zeros ignored; first value wins)."""
    with _lock:
        entry = _marks.get(transfer_id)
        if entry is None:
            entry = _marks[transfer_id] = {}
            while len(_marks) > MAX_MARKS:
                _marks.popitem(last=False)
        for field, value in instants.items():
            if value and not entry.get(field):
                entry[field] = value


def record_timing(transfer_id: str, timing: Timing | None) -> None:
    if timing is not None:
        record(transfer_id, **msgspec.structs.asdict(timing))


def take(transfer_id: str) -> Timing | None:
    """The instants recorded for ``transfer_id`` (and forget them); None if none."""
    with _lock:
        entry = _marks.pop(transfer_id, None)
    return Timing(**entry) if entry else None
