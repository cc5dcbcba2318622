"""A worker's engine metrics: vLLM's own ``vllm:*`` series (``PrometheusStatLogger``, which
vLLM's engine feeds at every step when stats are on) served on ``http://HOST:PORT/metrics``
(``--metrics-port``), for Prometheus to scrape next to the gateway's ``kvpush_*`` series.

vLLM records these in the process that runs its engine loop: a kvpush worker (``EngineHost``
drives ``LLMEngine`` in process), whatever the TP. The gateway's vLLM serving layer has no
engine, so it has none of them.

Threading model: ``prometheus_client``'s HTTP server runs on its own daemon thread; the
engine thread updates the metrics (prometheus-client metrics are thread-safe).
"""

from __future__ import annotations

from typing import Any


class EngineMetricsServer:
    """The ``/metrics`` endpoint of one worker; ``url`` once started, ``stop`` to end it."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host)
        bound = self._server.server_address
        self.url = f"http://{bound[0]}:{bound[1]}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
