"""Tracing for every kvpush process: which exporters its spans go to, the JSON-lines span
exporter, and the after-the-fact spans of the connector's critical path.

After-the-fact spans (``emit_span``): the connector's halves run on vLLM's threads, not inside
the worker's span, so each span is made with explicit start/end instants (unix ns) and the
request's parent context from its W3C ``traceparent``. With no SDK tracer provider installed
``emit_span`` returns at once: tracing off costs one ``isinstance`` check.

``configure_tracing(service_name, trace_file)`` installs one SDK ``TracerProvider`` as the global
provider, with a ``BatchSpanProcessor`` per exporter that ``--trace-file PATH`` (or
``KVPUSH_TRACE_FILE``: ``JsonLinesExporter``) and the standard ``OTEL_*`` variables ask for
(OTLP over HTTP or gRPC, console; the table in docs/observability.md).

With none of them set nothing is installed: the API's no-op tracer stays, and a span costs a
function call (``kvpush bench`` shows it does not move TTFT). ``configure_tracing_from_env`` is
what a connector in a separate engine process calls: the parent passes ``KVPUSH_TRACE_FILE`` and
the ``OTEL_*`` variables down through the environment.

The installed provider is OpenTelemetry's own process-wide one (``trace.get_tracer_provider``);
this module keeps no state of its own.

Threading model: call once per process from the main thread before serving; exporters run on
the processors' background threads; ``shutdown_tracing`` (registered with ``atexit``) flushes them.
``JsonLinesExporter.export`` runs on the BatchSpanProcessor thread; each batch is one
``os.write`` on a file opened with O_APPEND, so the gateway and both workers may share one file
(lines of different processes never interleave).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.schemas.spans import AttrValue, SpanEvent, SpanRecord

log = logging.getLogger(__name__)
TRACE_FILE_ENV = "KVPUSH_TRACE_FILE"
_encoder = msgspec.json.Encoder()
_tracer = trace.get_tracer("kvpush.connector")  # a proxy: follows the provider installed later
_propagator = TraceContextTextMapPropagator()
Attributes = Mapping[str, str | int | float | bool]


def _attrs(attributes: Any) -> dict[str, AttrValue]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in (attributes or {}).items()}


def record_from_span(span: ReadableSpan) -> SpanRecord:
    ctx = span.context
    parent = span.parent
    service = span.resource.attributes.get("service.name", "") if span.resource else ""
    return SpanRecord(
        trace_id=f"{ctx.trace_id:032x}",
        span_id=f"{ctx.span_id:016x}",
        parent_span_id=f"{parent.span_id:016x}" if parent is not None else "",
        name=span.name,
        kind=span.kind.name,
        service=str(service),
        start_ns=span.start_time or 0,
        end_ns=span.end_time or 0,
        status=span.status.status_code.name,
        attributes=_attrs(span.attributes),
        events=[
            SpanEvent(name=e.name, time_ns=e.timestamp, attributes=_attrs(e.attributes))
            for e in span.events
        ],
    )


class JsonLinesExporter(SpanExporter):
    """Appends each finished span as one JSON line to ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join(_encoder.encode(record_from_span(s)) + b"\n" for s in spans)
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _otlp_exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: kvpush supports grpc and http/protobuf"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def exporters_from_env(trace_file: str | None = None) -> list[SpanExporter]:
    """The exporters the arguments and environment ask for (empty: tracing off)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    exporters: list[SpanExporter] = []
    path = trace_file or os.environ.get(TRACE_FILE_ENV)
    if path:
        exporters.append(JsonLinesExporter(path))
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        names = "otlp"
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name == "otlp":
            exporters.append(_otlp_exporter())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: use otlp, console or none")
    return exporters


class UrandomIdGenerator(IdGenerator):
    """Span and trace ids from ``secrets`` (os.urandom). The SDK's default draws from the ``random``
    module, which vLLM seeds with the engine's seed in every engine process: a prefill and a
    decode worker then made the *same* span ids (seen as parent links pointing at the wrong
    process's span)."""

    def generate_span_id(self) -> int:
        return secrets.randbits(64) or self.generate_span_id()  # 0 is not a valid id

    def generate_trace_id(self) -> int:
        return secrets.randbits(128) or self.generate_trace_id()


def configure_tracing(service_name: str, trace_file: str | None = None) -> bool:
    """Install the global tracer provider; False (and nothing installed) when tracing is off.

    ``trace_file`` is also exported as ``KVPUSH_TRACE_FILE`` so engine subprocesses follow.
    """
    if tracing_on():
        return True
    exporters = exporters_from_env(trace_file)
    if not exporters:
        return False
    if trace_file:
        os.environ[TRACE_FILE_ENV] = os.path.abspath(trace_file)
    resource = Resource.create({"service.name": service_name, "service.namespace": "kvpush"})
    provider = TracerProvider(resource=resource, id_generator=UrandomIdGenerator())
    for exporter in exporters:
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, max_queue_size=8192)
        )
    trace.set_tracer_provider(provider)
    atexit.register(shutdown_tracing)
    log.info("tracing on: %s", ", ".join(type(e).__name__ for e in exporters))
    return True


def configure_tracing_from_env(service_name: str) -> bool:
    """``configure_tracing`` without arguments, unless a provider is already installed."""
    return configure_tracing(service_name)


def shutdown_tracing() -> None:
    """Flush and stop the exporters (idempotent)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()  # the SDK makes a second call a no-op


# ---- after-the-fact spans -------------------------------------------------------------------
def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(instant: float, now: float | None = None) -> int:
    """Unix ns of a ``time.monotonic()`` instant (for transport timestamps)."""
    now = time.monotonic() if now is None else now
    return time.time_ns() - int((now - instant) * 1e9)


def tracing_on() -> bool:
    """Is an SDK tracer provider installed (spans are recorded)?"""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def trace_parent(traceparent: str | None) -> Context | None:
    """The request's trace context (None when tracing is off or there is none)."""
    if not traceparent or not tracing_on():
        return None
    return _propagator.extract({"traceparent": traceparent})


def emit_span(
    name: str,
    traceparent: str | None,
    start_ns: int,
    end_ns: int,
    attributes: Attributes | None = None,
    events: Sequence[tuple[str, int, Attributes]] = (),
    error: str | None = None,
) -> None:
    """One finished span ``name`` under the request's trace (nothing when tracing is off)."""
    if not tracing_on() or not start_ns:
        return
    span = _tracer.start_span(
        name, context=trace_parent(traceparent), start_time=start_ns, attributes=attributes
    )
    for event_name, at_ns, event_attributes in events:
        span.add_event(event_name, event_attributes, timestamp=at_ns)
    if error:
        span.set_status(StatusCode.ERROR, error)
    span.end(end_time=max(end_ns, start_ns))
