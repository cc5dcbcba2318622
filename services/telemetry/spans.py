"""Readers of finished spans: a ``--trace-file`` (JSON lines) and OTLP/HTTP protobuf bodies.

Both give ``kvpush.schemas.spans.SpanRecord`` values; the writer of the file format is
``kvpush.connector.tracing.JsonLinesExporter``.

Threading model: plain functions.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from kvpush.schemas.spans import AttrValue, SpanEvent, SpanRecord

_decoder = msgspec.json.Decoder(SpanRecord)


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
        service = str(_kv_attrs(resource_spans.resource.attributes).get("service.name", ""))
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
