"""Finished spans as plain records: the JSON-lines file format, its exporter and its readers.

``SpanRecord`` is the one shape every kvpush tool reads spans in, whatever carried them: a
``--trace-file`` written by ``JsonLinesExporter`` (one JSON object per line), or OTLP/HTTP
protobuf received by ``kvpush ttft --listen`` (``records_from_otlp``). Times are unix ns, ids
lower-case hex as in W3C traceparent.

Threading model: ``JsonLinesExporter.export`` is called by the SDK's BatchSpanProcessor thread;
each batch is one ``os.write`` on a file opened with O_APPEND, so the gateway and both workers
may share one file (lines of different processes never interleave). Readers are plain functions.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

AttrValue = str | bool | int | float | list[str | bool | int | float]


class SpanEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    time_ns: int
    attributes: dict[str, AttrValue] = {}


class SpanRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One finished span; the line format of ``--trace-file``."""

    trace_id: str
    span_id: str
    name: str
    start_ns: int
    end_ns: int
    parent_span_id: str = ""
    kind: str = "INTERNAL"
    service: str = ""
    status: str = "UNSET"
    attributes: dict[str, AttrValue] = {}
    events: list[SpanEvent] = []

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SpanRecord)


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


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[SpanRecord]:
    """Records of a ``--trace-file``; a torn or foreign line is skipped."""
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError:
                continue


def _any_value(value: Any) -> AttrValue | None:
    kind = value.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    if kind == "array_value":
        items = [_any_value(v) for v in value.array_value.values]
        return [i for i in items if i is not None and not isinstance(i, list)]  # type: ignore[return-value]
    return None


def records_from_otlp(body: bytes) -> list[SpanRecord]:
    """Records of one OTLP/HTTP protobuf ``ExportTraceServiceRequest`` body."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    records: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        service = ""
        for kv in resource_spans.resource.attributes:
            if kv.key == "service.name":
                service = kv.value.string_value
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                records.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=_KINDS.get(span.kind, "INTERNAL"),
                        service=service,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        status=_STATUS.get(span.status.code, "UNSET"),
                        attributes=_kv_attrs(span.attributes),
                        events=[
                            SpanEvent(e.name, e.time_unix_nano, _kv_attrs(e.attributes))
                            for e in span.events
                        ],
                    )
                )
    return records


def _kv_attrs(pairs: Iterable[Any]) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for kv in pairs:
        value = _any_value(kv.value)
        if value is not None:
            out[kv.key] = value
    return out


_KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
