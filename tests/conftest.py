"""Session-wide fixtures: a real nats-server, an in-memory OpenTelemetry exporter, offline env.

Engines and servers start once per session (CI has 2 cores and a time budget). Engines live in
child processes only: a test module that imports vllm (directly or through the connector's
vLLM-facing modules) stops the run at collection, naming the module.
"""

from __future__ import annotations

import os
import subprocess
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


IN_CHILD = "KVPUSH_TEST_IN_CHILD"  # the node id of the test a child interpreter runs


@pytest.fixture
def in_child(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> bool:
    """For a test that must import vLLM (the suite's process never does): True in the child
    interpreter that runs the test; in the suite's process the fixture runs the test there,
    fails with the child's output if it failed, and returns False (the test then returns)."""
    node = request.node.nodeid
    if os.environ.get(IN_CHILD) == node:
        return True
    base = tmp_path_factory.mktemp("child")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node]
    done = subprocess.run(
        [*argv, "--basetemp", str(base)],
        env={**os.environ, IN_CHILD: node},
        cwd=request.config.rootpath,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (
        f"in a child interpreter:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )
    return False


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
