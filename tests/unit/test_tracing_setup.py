"""Which exporters the standard OTEL_* variables and --trace-file select, and that a configured
kvpush process really delivers its spans over OTLP/HTTP and OTLP/gRPC to a receiver.

The delivery checks run ``configure_tracing`` in a child process (it installs the global
tracer provider, which this test process keeps for its in-memory exporter) against receivers
started here: an aiohttp OTLP/HTTP endpoint and a grpcio TraceService.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

from kvpush.connector import tracing
from kvpush.connector.tracing import JsonLinesExporter
from kvpush.schemas.spans import SpanRecord
from kvpush.services.telemetry.spans import records_from_otlp

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    tracing.TRACE_FILE_ENV,
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def kinds(exporters: list) -> list[type]:
    kinds = [type(e) for e in exporters]
    for exporter in exporters:
        exporter.shutdown()
    return kinds


def test_nothing_set_means_tracing_off(clean_env: pytest.MonkeyPatch) -> None:
    assert tracing.exporters_from_env() == []


def test_each_variable_selects_its_exporter(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert kinds(tracing.exporters_from_env(str(tmp_path / "t.jsonl"))) == [JsonLinesExporter]
    clean_env.setenv(tracing.TRACE_FILE_ENV, str(tmp_path / "env.jsonl"))
    assert kinds(tracing.exporters_from_env()) == [JsonLinesExporter]
    clean_env.delenv(tracing.TRACE_FILE_ENV)
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert kinds(tracing.exporters_from_env()) == [HttpExporter]  # otlp implied, http default
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert kinds(tracing.exporters_from_env()) == [GrpcExporter]
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # traces win
    assert kinds(tracing.exporters_from_env()) == [HttpExporter]
    clean_env.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert kinds(tracing.exporters_from_env()) == [ConsoleSpanExporter, HttpExporter]
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.exporters_from_env() == []
    clean_env.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporters_from_env()
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.exporters_from_env()
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.exporters_from_env(str(tmp_path / "t.jsonl")) == []


CHILD = textwrap.dedent(
    """
    from opentelemetry import trace
    from kvpush.connector import tracing as telemetry
    assert telemetry.configure_tracing("kvpush-child")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("gateway.request", attributes={"kvpush.mode": "push"}):
        with tracer.start_as_current_span("gateway.route"):
            pass
    telemetry.shutdown_tracing()
    """
)


def run_child(env: dict[str, str]) -> None:
    base = {k: v for k, v in os.environ.items() if k not in OTEL_VARS}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def check(records: list[SpanRecord]) -> None:
    by_name = {r.name: r for r in records}
    assert set(by_name) == {"gateway.request", "gateway.route"}
    assert {r.service for r in records} == {"kvpush-child"}
    root, child = by_name["gateway.request"], by_name["gateway.route"]
    assert child.parent_span_id == root.span_id and child.trace_id == root.trace_id
    assert root.attributes == {"kvpush.mode": "push"}


async def test_spans_reach_an_otlp_http_receiver() -> None:
    bodies: list[bytes] = []

    async def receive(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        bodies.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        await asyncio.to_thread(run_child, env)
    finally:
        await runner.cleanup()
    check([r for body in bodies for r in records_from_otlp(body)])


def test_spans_reach_an_otlp_grpc_receiver() -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    bodies: list[bytes] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            bodies.append(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run_child(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            }
        )
    finally:
        server.stop(grace=None)
    check([r for body in bodies for r in records_from_otlp(body)])
