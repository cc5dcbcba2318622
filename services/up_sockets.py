"""The listening sockets ``kvpush up`` binds for its children before any of them starts.

A child that binds its own port late races the rest of the stack for it: the gateway binds
``--port`` only once it has imported vLLM and built its serving layer (seconds), a worker its
metrics port once it reached NATS, while the engines starting beside them bind ephemeral ports
(port 0) that may take a port picked free a moment before. So ``up`` binds each one itself
(``listen``): a port in use fails at once with one line (``ListenError``), before any engine
loads, and port 0 gets the kernel's pick, which ``up`` prints. The child gets the listening
socket as an inherited file descriptor (``Child.pass_fds``: the gateway's ``--listen-fd``, a
worker's ``--metrics-fd``) and serves on it; ``up`` keeps its own copy open until it stopped
that child, so a worker started again serves on the same socket: its URL never changes.

Threading model: none (short blocking calls, made on ``up``'s asyncio loop thread).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable, Mapping

from kvpush.services.workers.config import WorkerConfig
from kvpush.services.workers.flags import SETTINGS as WORKER_SETTINGS

# the address a worker's metrics server listens on: its side channel's (workers/worker.py)
SIDE_CHANNEL_HOST = next(row for row in WORKER_SETTINGS if row.name == "side_channel_host")


class ListenError(RuntimeError):
    """A socket ``up`` binds for a child cannot be had: says which port, where, and why."""


def listen(host: str, port: int, setting: str = "--port") -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (port 0: the kernel picks one; host "" or
    0.0.0.0: every IPv4 address; an address with ":" is IPv6), inheritable: a child started
    with its descriptor in ``pass_fds`` serves on it. The error names ``setting``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(
                f"port {port} on {host} is in use: stop what holds it or pick another {setting}"
            ) from None
        raise ListenError(f"cannot listen on {host}:{port} ({setting}): {exc}") from None
    sock.set_inheritable(True)
    return sock


def port_of(sock: socket.socket) -> int:
    """The port a bound socket has (the kernel's pick for port 0)."""
    return int(sock.getsockname()[1])


def close_all(sockets: Iterable[socket.socket | None]) -> None:
    """Close ``up``'s copies (closing one twice is nothing)."""
    for sock in sockets:
        if sock is not None:
            sock.close()


def reachable_host(host: str) -> str:
    """Where a client on this machine reaches a socket bound on ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def worker_metrics_host(environ: Mapping[str, str] = os.environ) -> str:
    """The address each worker's metrics server listens on: its ``--side-channel-host``, which
    ``up`` does not pass: the variable the workers inherit, else the workers' default."""
    return environ.get(SIDE_CHANNEL_HOST.variable) or WorkerConfig.side_channel_host


def listen_for_worker_metrics(host: str) -> socket.socket:
    """A worker's metrics socket: a port the kernel picks on ``host`` (``worker_metrics_host``)."""
    return listen(host, 0, SIDE_CHANNEL_HOST.variable)
