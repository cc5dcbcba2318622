"""Prometheus metrics of one gateway, in its own registry (two gateways in one process work).

Exposed at ``/metrics`` in the Prometheus text format 0.0.4. Counters by endpoint and HTTP
status, requests in flight, TTFT / TPOT / end-to-end latency histograms, the TTFT breakdown
(``kvpush_gateway_ttft_part_seconds{part}``), token counts, routing modes, routing decisions
by mode and reason with the decision's own cost (``kvpush_gateway_route_decisions_total{mode,
reason}``, ``kvpush_gateway_route_decision_seconds``), aborts, KV transfers
of this gateway's requests (bytes, seconds, outcomes, failures by reason, from the bus's
KvPushed / KvReady / KvFailed), and gauges read at scrape time (live workers by role,
token-stream anomalies, per worker free/total blocks, queue depth and in-flight requests from
the workers' heartbeats).

Threading model: prometheus-client metrics are thread-safe; the gateway updates them from its
event loop, and ``render`` runs there too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpush.schemas.messages import WorkerRole

if TYPE_CHECKING:
    from kvpush.services.gateway.streaming import StreamStats
    from kvpush.services.gateway.worker_registry import WorkerRegistry

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


TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
PART_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
WORKER_GAUGES = (
    ("kvpush_worker_free_blocks", "free KV blocks of the worker's engine", "free_blocks"),
    ("kvpush_worker_total_blocks", "KV blocks of the worker's engine", "total_blocks"),
    ("kvpush_worker_queue_depth", "requests waiting for the worker's own prefill", "queue_depth"),
    ("kvpush_worker_in_flight", "requests the worker is serving", "in_flight"),
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
        self.tpot = Histogram(
            "kvpush_gateway_time_per_output_token_seconds",
            "mean time between output tokens after the first, per request, by transfer mode",
            ["mode"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.ttft_part = Histogram(
            "kvpush_gateway_ttft_part_seconds",
            "TTFT breakdown: time of each critical-path part (see kvpush ttft), per request",
            ["part"],
            buckets=PART_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Counter(
            "kvpush_kv_transfer_bytes",
            "KV bytes moved for this gateway's requests (push: reported by P), by mode",
            ["mode"],
            registry=r,
        )
        self.kv_seconds = Histogram(
            "kvpush_kv_transfer_seconds",
            "push: first WRITE posted to last WRITE done, as P reports it",
            ["mode"],
            buckets=PART_BUCKETS,
            registry=r,
        )
        self.kv_transfers = Counter(
            "kvpush_kv_transfers",
            "KV transfers of this gateway's requests by outcome (done, ready, failed)",
            ["outcome"],
            registry=r,
        )
        self.kv_failures = Counter(
            "kvpush_kv_transfer_failures",
            "failed KV transfers by reason; decode then computes the prompt itself (fallback)",
            ["reason"],
            registry=r,
        )
        self.kv_outcomes = Counter(
            "kvpush_gateway_kv_outcomes",
            "push/pull requests by what decode did: received (the KV came from prefill), "
            "cached (decode's own prefix cache held the prompt: nothing to move) or fallback "
            "(decode computed the prompt itself)",
            ["mode", "outcome"],
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
        self.route_decisions = Counter(
            "kvpush_gateway_route_decisions",
            "routing decisions by chosen mode and reason: override (kvpush_mode), cold (the cost"
            " model lacks measurements: --local-threshold decided), cost (cheapest estimate),"
            " only-local (no prefill worker), least-loaded (--routing least-loaded)",
            ["mode", "reason"],
            registry=r,
        )
        self.route_decision_seconds = Histogram(
            "kvpush_gateway_route_decision_seconds",
            "the routed policy's own time per decision (prefix look-up and scoring)",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.migrations = Counter(
            "kvpush_gateway_migrations",
            "requests moved to other workers, by the role of the worker that died under them",
            ["lost"],
            registry=r,
        )
        self.aborts = Counter(
            "kvpush_gateway_aborts",
            "requests aborted by the gateway, by reason",
            ["reason"],
            registry=r,
        )

    def watch(self, workers: WorkerRegistry, stats: StreamStats) -> None:
        """Read at scrape time: live workers by role and their last heartbeats, and the token
        streams' chunk counts."""
        self.registry.register(_Scraped(workers, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Scraped(Collector):
    def __init__(self, workers: WorkerRegistry, stats: StreamStats) -> None:
        self.workers, self.stats = workers, stats

    def collect(self) -> Iterator[Metric]:
        doc = "live, non-draining workers by role"
        live = GaugeMetricFamily("kvpush_gateway_workers", doc, labels=["role"])
        for role, count in self.workers.counts().items():
            live.add_metric([role], float(count))
        yield live
        doc = "token chunks received, by outcome"
        chunks = CounterMetricFamily("kvpush_gateway_token_chunks", doc, labels=["outcome"])
        stats = self.stats
        chunks.add_metric(["delivered"], stats.chunks)
        chunks.add_metric(["unknown"], stats.unknown)
        chunks.add_metric(["duplicate"], stats.duplicates)
        chunks.add_metric(["reordered"], stats.reordered)
        chunks.add_metric(["overflow"], stats.overflows)
        yield chunks
        beats = [
            state.heartbeat
            for role in WorkerRole
            for state in self.workers.alive(role, include_draining=True)
        ]
        for name, doc, field in WORKER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["worker", "role"])
            for hb in beats:
                family.add_metric([hb.worker_id, hb.role.value], float(getattr(hb, field)))
            yield family
