"""Process-wide tracing setup: which exporters a kvpush process sends its spans to.

``configure(service_name, trace_file)`` installs one SDK ``TracerProvider`` as the global
provider, with a ``BatchSpanProcessor`` per exporter:

- ``--trace-file PATH`` (or ``KVPUSH_TRACE_FILE``): ``JsonLinesExporter``, one JSON line a span;
  several processes may append to one file.
- the standard OpenTelemetry variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
  ``none``; ``otlp`` is implied by ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``
  (``http/protobuf``, the default, or ``grpc``), the endpoint/headers variables read by the
  exporters themselves, ``OTEL_RESOURCE_ATTRIBUTES`` and
  ``OTEL_SDK_DISABLED``.

With none of them set nothing is installed: the API's no-op tracer stays, and a span costs a
function call (``kvpush bench`` shows it does not move TTFT). ``configure_from_env`` is what a
connector in a separate engine process calls: the parent passes ``KVPUSH_TRACE_FILE`` and the
``OTEL_*`` variables down through the environment.

Threading model: call once per process from the main thread before serving; exporters run on
the processors' background threads; ``shutdown`` (registered with ``atexit``) flushes them.
"""

from __future__ import annotations

import atexit
import logging
import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from kvpush.services.telemetry.spans import JsonLinesExporter

log = logging.getLogger(__name__)
TRACE_FILE_ENV = "KVPUSH_TRACE_FILE"

_provider: TracerProvider | None = None


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
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


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
    """Span and trace ids from ``os.urandom``. The SDK's default draws from the ``random``
    module, which vLLM seeds with the engine's seed in every engine process: a prefill and a
    decode worker then made the *same* span ids (seen as parent links pointing at the wrong
    process's span)."""

    def generate_span_id(self) -> int:
        while True:
            value = int.from_bytes(os.urandom(8), "big")
            if value:
                return value

    def generate_trace_id(self) -> int:
        while True:
            value = int.from_bytes(os.urandom(16), "big")
            if value:
                return value


def configure(service_name: str, trace_file: str | None = None) -> bool:
    """Install the global tracer provider; False (and nothing installed) when tracing is off.

    ``trace_file`` is also exported as ``KVPUSH_TRACE_FILE`` so engine subprocesses follow.
    """
    global _provider
    if _provider is not None:
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
    _provider = provider
    atexit.register(shutdown)
    log.info("tracing on: %s", ", ".join(type(e).__name__ for e in exporters))
    return True


def configure_from_env(service_name: str) -> bool:
    """``configure`` without arguments, unless a provider is already installed."""
    if _provider is not None or _has_sdk_provider():
        return True
    return configure(service_name)


def _has_sdk_provider() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def shutdown() -> None:
    """Flush and stop the exporters (idempotent)."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()
