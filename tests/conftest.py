"""Session-wide fixtures: a real nats-server, an in-memory OpenTelemetry exporter, offline env.

Engines and servers start once per session (CI has 2 cores and a time budget). Engines live in
child processes only: a test module that imports vllm (directly or through the connector's
vLLM-facing modules) stops the run at collection, naming the module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

from kvpush.connector.bus import Bus, BusConfig
from kvpush.services.natsd import EmbeddedNats

_EXPORTER = InMemorySpanExporter()


_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))
trace.set_tracer_provider(_PROVIDER)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Reports come module by module as each is imported: the first to see vllm imported it."""
    if "vllm" in sys.modules:
        raise pytest.UsageError(
            f"collecting {report.nodeid} imported vllm into the pytest process; engines run in "
            "child processes only (import vLLM-facing modules inside the child's code)"
        )


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The in-memory span exporter, emptied before each test that asks for it."""
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    connection = await Bus.connect(BusConfig(url=nats_server.url, name="test"))
    yield connection
    await connection.close()
