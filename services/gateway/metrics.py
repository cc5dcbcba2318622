"""Prometheus metrics of one gateway, in its own registry (two gateways in one process work).

Exposed at ``/metrics`` in the Prometheus text format 0.0.4. Counters by endpoint and HTTP
status, requests in flight, TTFT and end-to-end latency histograms, token counts, routing modes,
aborts, and gauges read at scrape time (live workers by role, token-stream anomalies).

Threading model: prometheus-client metrics are thread-safe; the gateway updates them from its
event loop, and ``render`` runs there too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class GatewayMetrics:
    """The gateway's metric families; see the module docstring."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvpush_gateway_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvpush_gateway_requests_in_flight", "generation requests being served", registry=r
        )
        self.ttft = Histogram(
            "kvpush_gateway_time_to_first_token_seconds",
            "request arrival to the first token chunk, by transfer mode",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvpush_gateway_request_duration_seconds",
            "request arrival to the last token chunk, by transfer mode",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpush_gateway_prompt_tokens", "prompt tokens of routed requests", registry=r
        )
        self.completion_tokens = Counter(
            "kvpush_gateway_completion_tokens", "completion tokens returned", registry=r
        )
        self.routed = Counter(
            "kvpush_gateway_routed_requests", "requests published, by mode", ["mode"], registry=r
        )
        self.aborts = Counter(
            "kvpush_gateway_aborts",
            "requests aborted by the gateway, by reason",
            ["reason"],
            registry=r,
        )
        self._sources: list[tuple[str, str, str, str, Callable[[], dict[str, float]]]] = []
        r.register(_SourceCollector(self._sources))

    def add_source(
        self, kind: str, name: str, doc: str, label: str, read: Callable[[], dict[str, float]]
    ) -> None:
        """A ``counter`` or ``gauge`` family whose values ``read()`` returns at scrape time."""
        self._sources.append((kind, name, doc, label, read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SourceCollector(Collector):
    def __init__(
        self, sources: list[tuple[str, str, str, str, Callable[[], dict[str, float]]]]
    ) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for kind, name, doc, label, read in self._sources:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, doc, labels=[label])
            for value_label, value in read().items():
                family.add_metric([value_label], value)
            yield family
