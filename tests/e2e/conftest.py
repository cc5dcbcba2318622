"""End-to-end fixtures: the embedded default stack from ``kvpush up`` and in-process gateways.

``up_stack`` (session) runs ``kvpush up`` as a user would, in its own session: it starts its
own nats-server, reuses (or builds) the cached tiny model, one prefill worker (core 0), one
decode worker (core 1) and the gateway on a port of its own pick (``--port 0``: the URL comes
from its banner), every service tracing into one
``--trace-file``. Tests talk to it over HTTP with the
official ``openai`` client, watch the workers' heartbeats over its NATS (``observer``), and
start extra gateways in process (``start_gateway``) on the same NATS or on an empty one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from kvpush.services.gateway import Gateway, GatewayConfig
from kvpush.services.up import BANNER_URL
from tests.integration.worker_proc import Observer

START_TIMEOUT_S = 240.0
PREFILL_ID, DECODE_ID = "prefill-0", "decode-0"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that stop (part of) the session's ``kvpush up`` run after every other test, in
    their order (the others, in any file, need the whole stack)."""
    items.sort(key=lambda item: item.get_closest_marker("stops_up_stack") is not None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class UpStack:
    proc: subprocess.Popen[bytes]
    url: str  # the gateway, http://127.0.0.1:<port>
    nats_url: str
    model_dir: str
    log_dir: Path

    @property
    def trace_file(self) -> Path:
        """Every service's spans (``kvpush up --trace-file``)."""
        return self.log_dir / "trace.jsonl"

    def output(self) -> str:
        return "".join(
            (self.log_dir / name).read_text(errors="replace") for name in ("up.err", "up.out")
        )

    def logs(self) -> str:
        """The end of each child's log, then up's own output last: a failure shows its tail,
        and up's lines say why it failed."""
        parts: list[str] = []
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-30:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(tail))
        parts.append(f"--- kvpush up ---\n{self.output()}")
        return "\n".join(parts)

    def membership_lines(self) -> str:
        """What the workers and the gateway logged about members leaving, stalls and aborts:
        why a transfer fell back, when one did."""
        marks = ("stalled", " left (", "aborting", "presumed dead", "failed_recving", "moves")
        lines = [
            f"{path.name}: {line}"
            for path in sorted(self.log_dir.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines()
            if any(mark in line for mark in marks)
        ]
        return "\n".join(lines[-40:]) or "(nothing logged about leaves, stalls or aborts)"

    def worker_pid(self, worker_id: str) -> int:
        for pid in child_pids(self.proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if worker_id.encode() in cmdline:
                return pid
        raise AssertionError(f"no process for {worker_id}")

    def client(self, **kwargs: Any) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    async def kv_outcomes(self, response_ids: list[str]) -> Counter[tuple[str, str]]:
        """(mode, kv outcome) of these responses, as the gateway recorded each request when it
        ended (``/dashboard/data``; just after its last byte, so wait until all are there):
        ``received`` (the KV came from P) or ``fallback`` (D computed the prompt itself)."""
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(f"{self.url}/dashboard/data") as resp:
                    rows = {r["request_id"]: r for r in (await resp.json())["requests"]}
                if all(rid in rows for rid in response_ids):
                    return Counter((rows[r]["mode"], rows[r]["kv"]) for r in response_ids)
                assert time.monotonic() < deadline, f"not all of {response_ids} were recorded"
                await asyncio.sleep(0.05)


@contextlib.contextmanager
def run_up(log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[UpStack]:
    """``kvpush up`` with ``extra`` flags (and ``env`` on top of ours) on a port it picks and
    binds itself (``--port 0``; read from its banner); ready when yielded, stopped after."""
    argv = [sys.executable, "-m", "kvpush.services.cli", "up", "--port", "0", *extra]
    with open(log_dir / "up.out", "wb") as out, open(log_dir / "up.err", "wb") as err:
        proc = subprocess.Popen(
            [*argv, "--log-dir", str(log_dir), "--trace-file", str(log_dir / "trace.jsonl")],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # like a terminal: only `up` gets our SIGINT
            # a drained worker finishes what it runs however busy the box (the drain tests
            # check that every token came, not how fast)
            env={**os.environ, "KVPUSH_DRAIN_TIMEOUT_S": "300", **(env or {})},
        )
    stack = UpStack(proc, "", "", "", log_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "kvpush is up" not in stack.output():
            assert proc.poll() is None, f"kvpush up exited ({proc.returncode})\n{stack.logs()}"
            assert time.monotonic() < deadline, f"kvpush up not ready\n{stack.logs()}"
            time.sleep(0.2)
        url = BANNER_URL.search(stack.output())
        nats = re.search(r"nats-server \(embedded, JetStream\): (nats://\S+)", stack.output())
        model = re.search(r"model kvpush-tiny: (\S+)", stack.output())
        assert url and nats and model, stack.output()
        stack.url, stack.nats_url, stack.model_dir = url.group(1), nats.group(1), model.group(1)
        yield stack
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def up_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    with run_up(tmp_path_factory.mktemp("kvpush-up")) as stack:
        yield stack


@pytest.fixture
async def observer(up_stack: UpStack) -> AsyncIterator[Observer]:
    """Heartbeats of the stack's workers, seen from a bus client of this test's own (closed
    with the test, while the stack's nats-server still runs: a nats-py client left
    reconnecting to a stopped server can hang the event loop's shutdown)."""
    obs = await Observer.connect(up_stack.nats_url, "gw-e2e-observer")
    yield obs
    await obs.close()


GatewayFactory = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def start_gateway(up_stack: UpStack) -> AsyncIterator[GatewayFactory]:
    """Start in-process gateways (GatewayConfig fields as keywords); stopped after the test."""
    started: list[Gateway] = []

    async def start(*, ready: bool = True, **overrides: Any) -> Gateway:
        """``ready``: return once the gateway saw a live worker of each role."""
        fields: dict[str, Any] = {
            "model": up_stack.model_dir,
            "nats_url": up_stack.nats_url,
            "port": 0,
            "shutdown_grace_s": 1.0,
            **overrides,
        }
        gateway = await Gateway.start(GatewayConfig(**fields))
        started.append(gateway)
        deadline = time.monotonic() + 10.0
        while ready and 0 in gateway.registry.counts().values():
            assert time.monotonic() < deadline, "the gateway saw no heartbeats"
            await asyncio.sleep(0.05)
        return gateway

    yield start
    for gateway in started:
        await gateway.stop()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Random prompts, different per test (prefix caches never join two tests by accident)."""
    return random.Random(request.node.nodeid)
