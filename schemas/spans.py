"""Finished spans as plain records: the line format of ``--trace-file`` and of every span reader.

``SpanRecord`` is the one shape every kvpush tool reads spans in, whatever carried them: a
``--trace-file`` written by ``kvpush.connector.tracing.JsonLinesExporter`` (one JSON object per
line), or OTLP/HTTP protobuf received by ``kvpush ttft --listen``. Times are unix ns, ids
lower-case hex as in W3C traceparent.

Threading model: none (values).
"""

from __future__ import annotations

import msgspec

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
