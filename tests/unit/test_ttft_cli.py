"""``kvpush ttft``: the table, summary, --json and --png of span files, and --listen (OTLP/HTTP)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import queue
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanKind
from PIL import Image

from kvpush.schemas.spans import SpanRecord
from kvpush.services.telemetry import ttft, ttft_listen, ttft_report, waterfall
from kvpush.services.telemetry.breakdown import PART_NAMES
from kvpush.services.telemetry.spans import read_jsonl

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
# Instants of one request (ms after arrival) and the parts they make, PART_NAMES order.
MARKS_MS = {
    "published": 1.0,
    "prefill_start": 3.0,
    "prefill_end": 43.0,
    "kv_sent": 45.5,
    "kv_landed": 46.0,
    "first_token": 52.0,
    "first_byte": 52.5,
}
PARTS_MS = (1.0, 2.0, 40.0, 2.5, 0.5, 6.0, 0.5)
CLI = [sys.executable, "-m", "kvpush.services.cli", "ttft"]


def request_spans(n: int, scale: float, mode: str = "push") -> list[SpanRecord]:
    """The spans of request ``n``: every instant of MARKS_MS times ``scale``."""
    trace_id, root = f"{n + 1:032x}", f"{n + 1:016x}"
    arrived = T0 + n * 1000 * MS
    at = {k: arrived + round(v * scale * MS) for k, v in MARKS_MS.items()}

    children = iter(range(1, 100))

    def span(name: str, start: int, end: int, **attributes: str) -> SpanRecord:
        return SpanRecord(
            trace_id=trace_id,
            span_id=f"{n + 1:08x}{next(children):08x}",
            parent_span_id=root,
            name=name,
            start_ns=start,
            end_ns=end,
            attributes=attributes,
        )

    return [
        SpanRecord(
            trace_id=trace_id,
            span_id=root,
            name="gateway.request",
            start_ns=arrived,
            end_ns=at["first_byte"] + 20 * MS,
            kind="SERVER",
            service="kvpush-gateway",
            attributes={"kvpush.request_id": f"req-{n:06d}", "kvpush.mode": mode},
        ),
        span(
            "bus.publish",
            at["published"] - MS // 10,
            at["published"],
            **{"messaging.destination.name": "kvpush.v1.req.p.d"},
        ),
        span("prefill.compute", at["prefill_start"], at["prefill_end"]),
        span("kv.push", at["prefill_end"] - 10 * MS, at["kv_sent"]),
        span("decode.wait_kv", at["prefill_start"], at["kv_landed"]),
        span("decode.first_token", at["kv_landed"], at["first_token"]),
        span("gateway.first_byte", at["first_token"], at["first_byte"]),
    ]


@pytest.fixture
def span_file(tmp_path: Path) -> Path:
    spans = request_spans(0, 1.0) + request_spans(1, 2.0, "pull") + request_spans(2, 3.0)
    spans.append(SpanRecord("ee" * 16, "01" * 8, "gateway.request", T0, T0 + MS))  # no first byte
    spans.append(SpanRecord("ff" * 16, "02" * 8, "bus.heartbeat", T0, T0 + MS))  # no root
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(s) + b"\n" for s in spans))
    return path


def row_of(out: str, request_id: str) -> tuple[str, list[float]]:
    (line,) = [line for line in out.splitlines() if line.startswith(request_id)]
    cells = line.split()
    return cells[1], [float(c) for c in cells[2:]]


def summary_of(out: str, label: str) -> list[float]:
    (line,) = [line for line in out.splitlines() if line.strip().startswith(label + "  ")]
    return [float(c) for c in line[len(label) + 2 :].split()[:3]]


def test_labels_follow_the_parts() -> None:
    assert len(ttft_report.PART_LABELS) == len(PART_NAMES) == len(waterfall.PALETTE)


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert ttft_report.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert ttft_report.percentile([0.0, 100.0], 99) == pytest.approx(99.0)
    assert ttft_report.percentile([7.0], 99) == 7.0
    assert ttft_report.percentile([1.0, 2.0, 3.0], 100) == 3.0


def test_table_summary_and_json(
    span_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "r.json"
    assert ttft.main([str(span_file), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for n, scale, mode in ((0, 1.0, "push"), (1, 2.0, "pull"), (2, 3.0, "push")):
        shown_mode, numbers = row_of(out, f"req-{n:06d}")
        assert shown_mode == mode
        assert numbers == pytest.approx([52.5 * scale, *(p * scale for p in PARTS_MS)], abs=0.01)
    header = next(line for line in out.splitlines() if line.startswith("request"))
    assert [header.index(label) for label in ttft_report.PART_LABELS] == sorted(
        header.index(label) for label in ttft_report.PART_LABELS
    )
    assert "3 complete requests" in out
    assert "skipped 2 traces: 1 without a gateway.request root, 1 without a first byte" in out
    # TTFTs 52.5, 105, 157.5: mean 105, p50 105, p99 105 + 0.98 * 52.5
    assert summary_of(out, "TTFT") == pytest.approx([105.0, 105.0, 156.45], abs=0.01)
    assert summary_of(out, "prefill compute") == pytest.approx([80.0, 80.0, 119.2], abs=0.01)

    report = json.loads(out_json.read_text())
    assert [r["request_id"] for r in report["requests"]] == [f"req-{n:06d}" for n in range(3)]
    first = report["requests"][0]
    assert first["ttft_ms"] == 52.5 and first["mode"] == "push"
    assert first["parts_ms"] == dict(zip(PART_NAMES, PARTS_MS, strict=True))
    summary = report["summary"]
    assert summary["count"] == 3 and summary["traces"] == 5
    assert (summary["skipped_no_root"], summary["skipped_no_first_byte"]) == (1, 1)
    assert summary["ttft_ms"] == {"mean": 105.0, "p50": 105.0, "p99": 156.45}
    assert summary["parts_ms"]["push_tail"] == {"mean": 5.0, "p50": 5.0, "p99": 7.45}
    assert report["parts"]["push_tail"] == "push tail"


def test_last_limits_rows_not_the_summary(
    span_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ttft.main([str(span_file), "--last", "1"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("req-")] == [
        "req-000002"
    ]
    assert "3 complete requests (rows: the last 1)" in out
    assert summary_of(out, "TTFT")[0] == pytest.approx(105.0, abs=0.01)


def test_png_is_a_waterfall_of_the_expected_width(
    span_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "w.png"
    assert ttft.main([str(span_file), "--png", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width == 1200 and image.height > 200
        colors = {rgb for _, rgb in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    for color in waterfall.PALETTE:  # every part shows: each is at least 1.5 ms of ~160
        assert tuple(int(color[i : i + 2], 16) for i in (1, 3, 5)) in colors


def test_waterfall_draws_the_last_rows(span_file: Path) -> None:
    found = ttft_report.analyze(read_jsonl(span_file)).breakdowns
    three, one = waterfall.render(found), waterfall.render(found, last=1)
    assert three.height - one.height == 2 * waterfall.ROW_HEIGHT
    assert waterfall.render(found, width=800).width == 800
    with pytest.raises(ValueError):
        waterfall.render([])


def test_short_id_keeps_the_tail_of_long_ids() -> None:
    (found,) = ttft_report.analyze(request_spans(0, 1.0)).breakdowns
    assert ttft_report.short_id(found) == "req-000000"
    long = dataclasses.replace(found, request_id="chatcmpl-0123456789abcdef")
    assert ttft_report.short_id(long) == "..456789abcdef"
    assert (
        ttft_report.short_id(dataclasses.replace(found, request_id=""))
        == ".." + found.trace_id[-12:]
    )


def test_no_complete_request_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(msgspec.json.encode(SpanRecord("ee" * 16, "01" * 8, "x", 1, 2)) + b"\n")
    assert ttft.main([str(path), "--png", str(tmp_path / "w.png")]) == 1
    assert "0 complete requests; skipped 1 trace: 1 without" in capsys.readouterr().out
    assert not (tmp_path / "w.png").exists()


def test_missing_file_is_a_one_line_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    done = subprocess.run([*CLI, str(missing)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"kvpush ttft: error: no such file: {missing}"]
    assert done.stdout == ""


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["t.jsonl", "--listen", "127.0.0.1:0"],
        ["t.jsonl", "--last", "-1"],
        ["t.jsonl", "--duration", "1"],
        ["--listen", "nowhere"],
    ],
)
def test_usage_errors_exit_2(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "t.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    assert ttft.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpush ttft: error: ") and err.count("\n") == 1


# -- --listen ------------------------------------------------------------------------------------


class _RecordIds(IdGenerator):
    """Hands out the ids of the record being re-made, so the SDK span keeps them."""

    trace_id = span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def otlp_request(service: str, spans: list[SpanRecord]) -> bytes:
    """``spans`` re-made by a local SDK provider named ``service`` (same ids, parents, times
    and attributes), encoded as an OTLP/HTTP ExportTraceServiceRequest body."""
    memory, ids = InMemorySpanExporter(), _RecordIds()
    provider = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("test")
    for record in spans:
        ids.trace_id, ids.span_id = int(record.trace_id, 16), int(record.span_id, 16)
        context = None
        if record.parent_span_id:  # in this batch or another one: a remote parent either way
            parent = trace.SpanContext(
                ids.trace_id, int(record.parent_span_id, 16), True, trace.TraceFlags(1)
            )
            context = trace.set_span_in_context(NonRecordingSpan(parent))
        kind = SpanKind.SERVER if record.name == "gateway.request" else SpanKind.INTERNAL
        span = tracer.start_span(
            record.name, context, kind, record.attributes, start_time=record.start_ns
        )
        span.end(end_time=record.end_ns)
    finished: list[ReadableSpan] = list(memory.get_finished_spans())
    provider.shutdown()
    assert [(s.context.trace_id, s.context.span_id) for s in finished] == [
        (int(r.trace_id, 16), int(r.span_id, 16)) for r in spans
    ]
    return encode_spans(finished).SerializeToString()


def post(url: str, body: bytes, content_type: str) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read(), answer.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers["Content-Type"]


def test_listen_prints_each_request_and_the_summary(tmp_path: Path) -> None:
    spans = request_spans(0, 1.0)
    gateway = [
        s for s in spans if s.name in ("gateway.request", "bus.publish", "gateway.first_byte")
    ]
    workers = [s for s in spans if s not in gateway]
    save, report = tmp_path / "saved.jsonl", tmp_path / "r.json"
    proc = subprocess.Popen(
        [
            *CLI,
            "--listen",
            "127.0.0.1:0",
            "--duration",
            "120",
            "--grace",
            "2",
            "--save",
            str(save),
            "--json",
            str(report),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True)
    reader.start()
    try:
        first = lines.get(timeout=60)
        assert first.startswith("listening for OTLP/HTTP protobuf on http://127.0.0.1:")
        url = first.split()[5]
        assert url.endswith("/v1/traces")
        # The gateway's batch completes the trace; P's and D's batch comes in afterwards.
        status, body, kind = post(
            url, otlp_request("kvpush-gateway", gateway), "application/x-protobuf"
        )
        assert (status, body, kind) == (200, b"", "application/x-protobuf")
        root = gateway[0]
        status, _, _ = post(url, otlp_request("kvpush-prefill", workers), "application/x-protobuf")
        assert status == 200
        assert post(url, b"{}", "application/json")[0] == 415
        assert post(url, b"\xff\xff\xff", "application/x-protobuf")[0] == 400
        while not (line := lines.get(timeout=60)).startswith("req-"):
            pass
        assert row_of(line, "req-000000")[1] == pytest.approx([52.5, *PARTS_MS], abs=0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=60)  # stdout is closed: every line is in the queue
    text = "".join(lines.get() for _ in range(lines.qsize()))
    assert "1 complete request" in text
    assert summary_of(text, "TTFT") == pytest.approx([52.5, 52.5, 52.5], abs=0.01)
    saved = list(read_jsonl(save))
    assert sorted(s.name for s in saved) == sorted(s.name for s in spans)
    assert {s.trace_id for s in saved} == {root.trace_id}
    assert {s.service for s in saved} == {"kvpush-gateway", "kvpush-prefill"}
    assert json.loads(report.read_text())["requests"][0]["parts_ms"]["prefill_compute"] == 40.0


async def test_receiver_protocol(tmp_path: Path) -> None:
    collector = ttft_listen.Collector(grace_s=60, save=None)
    async with TestClient(TestServer(ttft_listen.make_app(collector))) as client:
        body = otlp_request("kvpush-gateway", request_spans(3, 1.0))
        answer = await client.post(
            "/v1/traces",
            data=gzip.compress(body),
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
        )
        assert answer.status == 200 and await answer.read() == b""
        assert answer.content_type == "application/x-protobuf"
        assert len(list(collector.spans())) == 7
        for content_type in ("text/plain", "application/json"):
            bad = await client.post("/v1/traces", data=body, headers={"Content-Type": content_type})
            assert bad.status == 415
        garbage = await client.post(
            "/v1/traces", data=b"not protobuf", headers={"Content-Type": "application/x-protobuf"}
        )
        assert garbage.status == 400
        assert len(list(collector.spans())) == 7
        assert collector.printed == 0  # complete, but still in its grace period
    collector.flush()  # the grace period is cut short: the row is printed now
    assert collector.printed == 1
