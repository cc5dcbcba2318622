"""A worker's own Prometheus series, served beside vLLM's ``vllm:*`` on its ``--metrics-port``
(or ``--metrics-fd``), and the HTTP server that serves them (``serve_metrics``).

``IntegrityCollector``: a decode worker's KV integrity outcomes as the counter family
``kvpush_kv_integrity_total{outcome}`` (``verified``, ``mismatch``: D computed the prompt
itself, ``unchecked``: landed without a checksum to compare, ``stale``: a notice or bus word of
another allocation, dropped; any other outcome the connector reports, e.g. ``off``, gets its own
label value). The counts live in the connector (``EngineLink.integrity_counts``: the scheduler
half's, or over ``collective_rpc`` the engine-core process's ranks', ``CoreLink``), so the
collector keeps none: it reads them at scrape time. One collector per worker, registered as it
is made (when the worker starts its metrics server) and unregistered at its stop (``close``).

``worker_registry``: what a worker's metrics server serves, its own ``CollectorRegistry``
(its ``IntegrityCollector``) that also yields prometheus_client's process-global ``REGISTRY``
(vLLM's ``vllm:*``, recorded there) at each scrape. Two workers in one process (tests) each
serve their own series beside the shared ones; nothing of a worker is registered globally.

``serve_metrics``: a registry over HTTP, on ``--side-channel-host``:``--metrics-port``
(prometheus_client's own server), or on the listening socket of ``--metrics-fd``, bound by a
parent that holds it (``kvpush up``: no other process can take the port while the worker
starts, and a worker started again serves on the same socket): ``HeldSocketServer``, the same
WSGI app on a socket adopted as it is. Either answers ``shutdown`` and ``server_close``.

Threading model: each server runs ``serve_forever`` on a daemon thread of its own and each
scrape on a daemon thread (``collect`` runs there, once per scrape); the counts source must be
callable from any thread (both links' ``integrity_counts`` are). A source that fails (the
engine stopping) yields a family without samples, and a warning.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

log = logging.getLogger(__name__)

INTEGRITY_METRIC = "kvpush_kv_integrity"  # exposed as kvpush_kv_integrity_total
# always present (0 until the first of its kind), so that rate() sees every series from start
INTEGRITY_OUTCOMES = ("verified", "mismatch", "unchecked", "stale")
INTEGRITY_HELP = (
    "KV transfers D verified before use, by outcome (mismatch: D computed the prompt itself;"
    " unchecked: no checksum to compare; stale: dropped words of an old allocation)"
)


class GlobalMetrics(Collector):
    """Every series of prometheus_client's process-global ``REGISTRY`` (or ``source``), read at
    each collect; registered without names, so a worker registry never clashes with them."""

    def __init__(self, source: CollectorRegistry = REGISTRY) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        yield from self._source.collect()


def worker_registry(shared: CollectorRegistry = REGISTRY) -> CollectorRegistry:
    """A worker's own registry: its collectors plus, at each scrape, ``shared``'s series."""
    registry = CollectorRegistry(support_collectors_without_names=True)
    registry.register(GlobalMetrics(shared))
    return registry


class IntegrityCollector(Collector):
    """``kvpush_kv_integrity_total{outcome}`` read from ``counts`` at each scrape; registered
    in ``registry`` (the worker's own, ``worker_registry``) as it is made (ValueError: the
    family is there already)."""

    def __init__(self, counts: Callable[[], dict[str, int]], registry: CollectorRegistry) -> None:
        self._counts = counts
        self._registry = registry
        registry.register(self)  # asks ``describe``, not the engine
        self._registered = True

    def describe(self) -> Iterator[Metric]:
        """The family without samples: registering asks the engine nothing."""
        yield CounterMetricFamily(INTEGRITY_METRIC, INTEGRITY_HELP, labels=["outcome"])

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(INTEGRITY_METRIC, INTEGRITY_HELP, labels=["outcome"])
        try:
            counts = self._counts()
        except Exception as exc:  # the engine is stopping, or its process is gone
            log.warning("KV integrity counts unavailable: %s", exc)
            yield family
            return
        outcomes = [*INTEGRITY_OUTCOMES, *sorted(set(counts) - set(INTEGRITY_OUTCOMES))]
        for outcome in outcomes:
            family.add_metric([outcome], float(counts.get(outcome, 0)))
        yield family

    def close(self) -> None:
        """Unregister (the worker stops); again: nothing."""
        if self._registered:
            self._registry.unregister(self)
            self._registered = False


class QuietHandler(WSGIRequestHandler):
    """A scrape logs no access line."""

    def log_message(self, format: str, *args: object) -> None:
        """Nothing."""


class HeldSocketServer(ThreadingMixIn, WSGIServer):
    """A WSGI server on a socket that listens already (bound by a parent, inherited): it binds
    and listens on nothing itself; a thread per request, daemon threads (a slow scrape never
    holds the worker's exit)."""

    daemon_threads = True

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.getsockname()[:2], QuietHandler, bind_and_activate=False)
        self.socket.close()  # the one TCPServer made: this server serves ``sock``
        self.socket = sock
        self.server_bind()
        self.server_activate()

    def server_bind(self) -> None:
        """Adopt the socket's address (no bind: it is bound)."""
        host, port = self.socket.getsockname()[:2]
        self.server_address = (host, port)
        self.server_name, self.server_port = host, port
        self.setup_environ()

    def server_activate(self) -> None:
        """Nothing: the socket listens already."""


def serve_on_socket(sock: socket.socket, registry: CollectorRegistry) -> HeldSocketServer:
    """Serve ``registry`` (``/metrics``) on the listening ``sock``, from a daemon
    thread; ``shutdown`` then ``server_close`` stop it and close ``sock``."""
    server = HeldSocketServer(sock)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="kvpush-metrics", daemon=True).start()
    return server


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int | None, fd: int | None
) -> WSGIServer:
    """A worker's metrics server: on the inherited listening socket ``fd`` (``--metrics-fd``),
    else on ``host``:``port`` (``--metrics-port``; 0: any free port)."""
    if fd is None:
        server, _ = start_http_server(port or 0, addr=host, registry=registry)
        return server
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise RuntimeError(f"--metrics-fd {fd}: no socket there ({exc})") from None
    sock.set_inheritable(False)  # the worker's alone, not the processes its engine starts
    return serve_on_socket(sock, registry)
