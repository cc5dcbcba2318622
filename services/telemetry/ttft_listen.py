"""``kvpush ttft --listen``: an OTLP/HTTP receiver that prints each request's breakdown live.

This module owns the receiving half of ``kvpush ttft`` (``ttft`` owns the command, the table and
the summary): ``POST /v1/traces`` with an OTLP/HTTP protobuf ``ExportTraceServiceRequest``
(answered 200 with an empty ``ExportTraceServiceResponse``; 415 for another content type, 400
for a body that does not decode), the spans collected by trace, a request's row printed once
its trace has a ``gateway.request`` root and a ``gateway.first_byte`` span plus a grace period
(spans of P and D arrive in other batches, from other processes), and ``--save``.

Threading model: everything runs on one asyncio loop, on the thread that calls ``run_listen``
(SIGINT/SIGTERM handlers are installed only when that is the main thread); a completed trace's
row is printed by a ``loop.call_later`` timer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator, Sequence

import msgspec
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from kvpush.schemas.spans import SpanRecord
from kvpush.services.telemetry.breakdown import breakdowns_from_spans
from kvpush.services.telemetry.spans import records_from_otlp
from kvpush.services.telemetry.ttft_report import (
    Report,
    UsageError,
    analyze,
    table_header,
    table_row,
)

OTLP_CONTENT_TYPE = "application/x-protobuf"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text}: expected HOST:PORT, e.g. 127.0.0.1:4318")
    return host.strip("[]") or "0.0.0.0", int(port)


class Collector:
    """The spans received so far, by trace; prints a trace's row ``grace_s`` after the trace
    first has both its ``gateway.request`` and its ``gateway.first_byte``."""

    def __init__(self, grace_s: float, save: str | None) -> None:
        self.grace_s = grace_s
        self.traces: dict[str, list[SpanRecord]] = {}
        self.printed = 0
        self._due: dict[str, asyncio.TimerHandle] = {}
        self._seen_complete: set[str] = set()
        self._save_fd = os.open(save, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if save else -1

    def add(self, records: Sequence[SpanRecord]) -> None:
        if self._save_fd >= 0 and records:
            view = memoryview(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
            while view:  # one write per batch (O_APPEND): lines of one batch stay together
                view = view[os.write(self._save_fd, view) :]
        for record in records:
            self.traces.setdefault(record.trace_id, []).append(record)
        loop = asyncio.get_running_loop()
        for trace_id in {r.trace_id for r in records} - self._seen_complete:
            names = {s.name for s in self.traces[trace_id]}
            if {"gateway.request", "gateway.first_byte"} <= names:
                self._seen_complete.add(trace_id)
                self._due[trace_id] = loop.call_later(self.grace_s, self._emit, trace_id)

    def _emit(self, trace_id: str) -> None:
        self._due.pop(trace_id, None)
        for b in breakdowns_from_spans(self.traces[trace_id]):
            if not self.printed:
                print(table_header())
            self.printed += 1
            print(table_row(b), flush=True)

    def flush(self) -> None:
        """Prints the rows still waiting for their grace period."""
        for trace_id, handle in list(self._due.items()):
            handle.cancel()
            self._emit(trace_id)

    def close(self) -> None:
        if self._save_fd >= 0:
            os.close(self._save_fd)
            self._save_fd = -1

    def spans(self) -> Iterator[SpanRecord]:
        for records in self.traces.values():
            yield from records


def make_app(collector: Collector) -> web.Application:
    """The OTLP/HTTP receiver: ``POST /v1/traces`` with an ExportTraceServiceRequest."""
    answer = ExportTraceServiceResponse().SerializeToString()

    async def traces(request: web.Request) -> web.Response:
        if request.content_type != OTLP_CONTENT_TYPE:
            return web.Response(
                status=415, text=f"kvpush ttft takes {OTLP_CONTENT_TYPE} (OTLP/HTTP protobuf)\n"
            )
        body = await request.read()
        try:
            records = records_from_otlp(body)
        except Exception as exc:  # any undecodable body is the sender's fault
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {exc}\n")
        collector.add(records)
        return web.Response(body=answer, content_type=OTLP_CONTENT_TYPE)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", traces)
    return app


async def serve(args: argparse.Namespace, collector: Collector) -> None:
    host, port = parse_address(args.listen)
    runner = web.AppRunner(make_app(collector), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise UsageError(f"--listen {args.listen}: {exc.strerror or exc}") from None
        shown = f"[{host}]" if ":" in host else host
        print(
            f"listening for OTLP/HTTP protobuf on http://{shown}:{runner.addresses[0][1]}/v1/traces"
            " (Ctrl-C ends it)",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            # off the main thread, or where signals cannot be handled: no handlers
            with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=args.duration)
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
    finally:
        await runner.cleanup()
        collector.flush()


def run_listen(args: argparse.Namespace) -> Report:
    try:
        collector = Collector(args.grace, args.save)
    except OSError as exc:
        raise UsageError(f"--save {args.save}: {exc.strerror or exc}") from None
    try:
        asyncio.run(serve(args, collector))
    except KeyboardInterrupt:  # before the handlers were installed
        collector.flush()
    finally:
        collector.close()
    if collector.printed:
        print()
    return analyze(collector.spans())
