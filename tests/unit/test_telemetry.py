"""Span records, their JSON-lines exporter and OTLP reader, and the TTFT breakdown."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvpush.connector.tracing import JsonLinesExporter, record_from_span
from kvpush.schemas.messages import Timing
from kvpush.schemas.spans import SpanRecord
from kvpush.services.telemetry.breakdown import (
    PART_NAMES,
    PARTS,
    breakdown,
    breakdowns_from_spans,
    timing_from_spans,
)
from kvpush.services.telemetry.spans import read_jsonl, records_from_otlp

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
MARKS = [field for _, field in PARTS]  # published .. first_byte


def _provider(service: str = "kvpush-test") -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _sdk_spans(service: str = "kvpush-test") -> list[ReadableSpan]:
    """A parent and a child with every attribute type, an event and an error status."""
    provider, memory = _provider(service)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(
        "gateway.request",
        kind=SpanKind.SERVER,
        attributes={"kvpush.request_id": "r-1", "n": 3, "x": 0.25, "ok": True, "tags": ("a", "b")},
    ) as parent:
        parent.set_status(Status(StatusCode.OK))
        with tracer.start_as_current_span("bus.publish", kind=SpanKind.PRODUCER) as child:
            child.add_event("retry", {"attempt": 2})
            child.set_status(Status(StatusCode.ERROR, "boom"))
    provider.shutdown()
    return list(memory.get_finished_spans())


# -- breakdown ---------------------------------------------------------------------------------

mark_values = st.one_of(st.just(0), st.integers(min_value=T0 - 10**9, max_value=T0 + 10**10))


@given(
    arrived=st.integers(min_value=T0, max_value=T0 + 10**9),
    ttft_ns=st.integers(min_value=0, max_value=10**10),
    marks=st.lists(mark_values, min_size=len(MARKS) - 1, max_size=len(MARKS) - 1),
)
def test_breakdown_telescopes_to_first_byte_minus_arrived(
    arrived: int, ttft_ns: int, marks: list[int]
) -> None:
    timing = Timing(
        arrived=arrived, first_byte=arrived + ttft_ns, **dict(zip(MARKS[:-1], marks, strict=True))
    )
    found = breakdown(timing)
    assert found is not None
    assert len(found.parts_ms) == len(PART_NAMES)
    assert all(part >= 0 for part in found.parts_ms)
    assert math.isclose(found.ttft_ms, ttft_ns / MS, rel_tol=1e-9, abs_tol=1e-6)
    assert found.start_ns == arrived


def _timing(**ms: float) -> Timing:
    return Timing(**{k: T0 + int(v * MS) for k, v in ms.items()})


def test_breakdown_in_order_marks_give_their_gaps() -> None:
    found = breakdown(
        _timing(
            arrived=0,
            published=1,
            prefill_start=3,
            prefill_end=43,
            kv_sent=45.5,
            kv_landed=46,
            first_token=52,
            first_byte=52.5,
        )
    )
    assert found is not None
    assert found.parts_ms == (1.0, 2.0, 40.0, 2.5, 0.5, 6.0, 0.5)
    assert found.ttft_ms == 52.5


def test_breakdown_clamps_out_of_order_and_missing_marks() -> None:
    # prefill_start before published: no queue, compute counted from published; kv_sent
    # missing: no push tail, D's wait counted from prefill_end; first_token after first_byte:
    # clamped, streaming is zero.
    found = breakdown(
        _timing(
            arrived=0,
            published=2,
            prefill_start=1,
            prefill_end=10,
            kv_landed=12,
            first_token=30,
            first_byte=20,
        )
    )
    assert found is not None
    assert dict(zip(PART_NAMES, found.parts_ms, strict=True)) == {
        "gateway": 2.0,
        "queue_prefill": 0.0,
        "prefill_compute": 8.0,
        "push_tail": 0.0,
        "decode_wait": 2.0,
        "decode_first_step": 8.0,
        "streaming": 0.0,
    }
    # a mark before arrival is clamped to arrival
    early = breakdown(_timing(arrived=5, published=1, first_byte=9))
    assert early is not None and early.parts_ms[0] == 0.0 and early.ttft_ms == 4.0


def test_breakdown_needs_arrived_and_a_later_first_byte() -> None:
    assert breakdown(_timing(arrived=0, published=1)) is None
    assert breakdown(Timing(first_byte=T0)) is None
    assert breakdown(_timing(arrived=5, first_byte=4)) is None


def _span(name: str, start_ms: float, end_ms: float, **kw: object) -> SpanRecord:
    return SpanRecord(
        trace_id="ab" * 16,
        span_id=str(kw.pop("span_id", f"{abs(hash((name, start_ms))) % 2**63:016x}")),
        name=name,
        start_ns=T0 + int(start_ms * MS),
        end_ns=T0 + int(end_ms * MS),
        **kw,  # type: ignore[arg-type]
    )


def test_timing_from_spans_picks_the_request_publish_of_the_root() -> None:
    root = _span("gateway.request", 0, 100, span_id="1" * 16)
    other = _span("decode.first_token", 40, 50, span_id="2" * 16)
    req = {"messaging.destination.name": "kvpush.v1.req.p0.d0"}
    spans = [
        root,
        other,
        # a publish under another parent, on a request subject: not the gateway's
        _span("bus.publish", 0.2, 0.5, parent_span_id=other.span_id, attributes=req),
        # the root's publish on another subject
        _span(
            "bus.publish",
            0.1,
            0.7,
            parent_span_id=root.span_id,
            attributes={"messaging.destination.name": "kvpush.v1.tok.gw"},
        ),
        _span("bus.publish", 1.0, 1.5, parent_span_id=root.span_id, attributes=req),
        _span("gateway.first_byte", 50, 51, parent_span_id=root.span_id),
    ]
    timing = timing_from_spans(spans)
    assert timing.arrived == root.start_ns
    assert timing.published == T0 + int(1.5 * MS)
    assert timing.first_token == T0 + 50 * MS
    assert timing.first_byte == T0 + 51 * MS
    (found,) = breakdowns_from_spans(spans)
    assert found.parts_ms[0] == 1.5


# -- JSON lines ----------------------------------------------------------------------------------


def test_jsonl_exporter_round_trip_through_an_sdk_provider(tmp_path: Path) -> None:
    path = tmp_path / "spans" / "t.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "kvpush-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    tracer = provider.get_tracer("test")
    with (
        tracer.start_as_current_span(
            "gateway.request",
            kind=SpanKind.SERVER,
            attributes={"kvpush.mode": "push", "ids": (1, 2)},
        ) as root,
        tracer.start_as_current_span("bus.publish", kind=SpanKind.PRODUCER) as child,
    ):
        child.add_event("sent", {"bytes": 128})
        child.set_status(Status(StatusCode.ERROR))
    provider.shutdown()

    records = {r.name: r for r in read_jsonl(path)}
    assert set(records) == {"gateway.request", "bus.publish"}
    parent, publish = records["gateway.request"], records["bus.publish"]
    assert parent.trace_id == publish.trace_id == f"{root.get_span_context().trace_id:032x}"
    assert parent.span_id == f"{root.get_span_context().span_id:016x}"
    assert publish.span_id == f"{child.get_span_context().span_id:016x}"
    assert publish.parent_span_id == parent.span_id and parent.parent_span_id == ""
    assert (parent.kind, publish.kind) == ("SERVER", "PRODUCER")
    assert parent.service == publish.service == "kvpush-gateway"
    assert parent.attributes == {"kvpush.mode": "push", "ids": [1, 2]}
    assert publish.status == "ERROR"
    assert [(e.name, e.attributes) for e in publish.events] == [("sent", {"bytes": 128})]
    assert parent.start_ns <= publish.start_ns <= publish.end_ns <= parent.end_ns
    assert parent.duration_ms == (parent.end_ns - parent.start_ns) / 1e6


def test_two_exporters_appending_to_one_file_do_not_interleave(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    provider, memory = _provider()
    tracer = provider.get_tracer("test")
    for i in range(64):  # each span ~8 KB: a batch is far over PIPE_BUF
        tracer.start_span(f"s{i}", attributes={"pad": "x" * 8192, "i": i}).end()
    spans = list(memory.get_finished_spans())
    exporters = [JsonLinesExporter(path), JsonLinesExporter(path)]
    start = threading.Barrier(len(exporters))

    def export(exporter: JsonLinesExporter) -> None:
        start.wait()
        for _ in range(20):
            for batch in range(0, len(spans), 8):
                exporter.export(spans[batch : batch + 8])

    threads = [threading.Thread(target=export, args=(e,)) for e in exporters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for exporter in exporters:
        exporter.shutdown()

    decoder = msgspec.json.Decoder(SpanRecord)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 2 * 20 * len(spans)
    records = [decoder.decode(line) for line in lines]  # raises on a torn line
    assert all(r.attributes["pad"] == "x" * 8192 for r in records)


def test_read_jsonl_skips_torn_and_foreign_lines(tmp_path: Path) -> None:
    record = SpanRecord(trace_id="ab" * 16, span_id="cd" * 8, name="x", start_ns=1, end_ns=2)
    good = msgspec.json.encode(record)
    path = tmp_path / "t.jsonl"
    path.write_bytes(good + b"\n\n" + good[:20] + b"\n" + b'{"other": 1}\n' + good + b"\n")
    assert list(read_jsonl(path)) == [record, record]


def test_exporter_after_shutdown_fails_cleanly(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = JsonLinesExporter(tmp_path / "t.jsonl")
    exporter.shutdown()
    assert exporter.export(_sdk_spans()) is SpanExportResult.FAILURE


# -- OTLP ----------------------------------------------------------------------------------------


def test_records_from_otlp_match_the_sdk_spans() -> None:
    spans = _sdk_spans("kvpush-decode")
    body = encode_spans(spans).SerializeToString()
    received = records_from_otlp(body)
    expected = [record_from_span(s) for s in spans]
    assert sorted(received, key=lambda r: r.span_id) == sorted(expected, key=lambda r: r.span_id)
    by_name = {r.name: r for r in received}
    root = by_name["gateway.request"]
    assert root.service == "kvpush-decode" and root.kind == "SERVER" and root.status == "OK"
    assert root.attributes == {
        "kvpush.request_id": "r-1",
        "n": 3,
        "x": 0.25,
        "ok": True,
        "tags": ["a", "b"],
    }
    publish = by_name["bus.publish"]
    assert publish.parent_span_id == root.span_id and publish.status == "ERROR"
    assert publish.events[0].attributes == {"attempt": 2}


def test_records_from_otlp_of_an_empty_request() -> None:
    assert records_from_otlp(b"") == []


def test_local_providers_leave_the_global_one_alone() -> None:
    before = trace.get_tracer_provider()
    _sdk_spans()
    assert trace.get_tracer_provider() is before
