"""``IntegrityCollector``: a decode worker's KV integrity counts as
``kvpush_kv_integrity_total{outcome}``, read from its link at each scrape (a fake link here);
and ``serve_metrics`` on a listening socket a parent bound (``--metrics-fd``)."""

from __future__ import annotations

import random
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvpush.services.workers.worker_metrics import (
    INTEGRITY_OUTCOMES,
    IntegrityCollector,
    serve_metrics,
    worker_registry,
)

SERIES = "kvpush_kv_integrity_total"


class FakeLink:
    """What the collector reads: ``integrity_counts`` (how often it was asked, too)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.asked = 0
        self.fails = False

    def integrity_counts(self) -> dict[str, int]:
        self.asked += 1
        if self.fails:
            raise RuntimeError("CoreEngineHost is not running")
        return dict(self.counts)


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    """outcome label -> value of every ``kvpush_kv_integrity_total`` sample."""
    found: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == SERIES:
                found[sample.labels["outcome"]] = sample.value
    return found


def test_every_outcome_is_a_labelled_counter_read_at_scrape_time() -> None:
    rng = random.Random(31)
    counts = {name: rng.randrange(1, 1000) for name in INTEGRITY_OUTCOMES}
    link, registry = FakeLink({}), CollectorRegistry()
    collector = IntegrityCollector(link.integrity_counts, registry)
    assert link.asked == 0  # registering asks the engine nothing
    assert scrape(registry) == dict.fromkeys(INTEGRITY_OUTCOMES, 0.0)  # before any receive
    link.counts = counts
    assert scrape(registry) == {name: float(n) for name, n in counts.items()}
    link.counts = {**counts, "verified": counts["verified"] + 1, "off": 2}
    seen = scrape(registry)
    assert seen["verified"] == counts["verified"] + 1 and seen["off"] == 2.0, seen
    text = generate_latest(registry).decode()
    assert f"# TYPE {SERIES} counter" in text, text
    assert f'{SERIES}{{outcome="mismatch"}} {float(counts["mismatch"])}' in text, text
    collector.close()


def test_close_unregisters_and_a_failing_link_yields_no_samples() -> None:
    link, registry = FakeLink({"verified": 3}), CollectorRegistry()
    collector = IntegrityCollector(link.integrity_counts, registry)
    link.fails = True
    assert scrape(registry) == {}  # the scrape still answers
    collector.close()
    link.fails = False
    asked = link.asked
    assert scrape(registry) == {} and link.asked == asked
    collector.close()  # twice: nothing
    IntegrityCollector(link.integrity_counts, registry)  # the name is free again
    assert scrape(registry)["verified"] == 3.0


def test_one_collector_per_registry() -> None:
    """A second collector of the family in the same registry is refused: a worker that did not
    unregister its own at stop would make the next one's start fail."""
    registry = CollectorRegistry()
    IntegrityCollector(FakeLink({}).integrity_counts, registry)
    with pytest.raises(ValueError):
        IntegrityCollector(FakeLink({}).integrity_counts, registry)


def test_two_workers_in_one_process_serve_their_own_counts_beside_the_shared_series() -> None:
    """Each worker's registry holds its own collector and yields the shared registry's series
    (vLLM's vllm:*, in prometheus_client's process-global one; a stand-in here) at each scrape:
    a second decode worker in the process registers nothing twice."""
    shared = CollectorRegistry()
    engine_steps = Counter("vllm_test_steps", "engine steps", registry=shared)
    links = [FakeLink({"verified": 3}), FakeLink({"verified": 5})]
    registries = [worker_registry(shared), worker_registry(shared)]
    for link, registry in zip(links, registries, strict=True):
        IntegrityCollector(link.integrity_counts, registry)
    engine_steps.inc(7)
    assert [scrape(r)["verified"] for r in registries] == [3.0, 5.0]
    for registry in registries:
        text = generate_latest(registry).decode()
        assert "vllm_test_steps_total 7.0" in text, text
        # what a scrape with ?name[]=... serves: both kinds still answer
        names = [SERIES, "vllm_test_steps_total"]
        restricted = generate_latest(registry.restricted_registry(names)).decode()  # type: ignore[arg-type]
        assert "vllm_test_steps_total 7.0" in restricted and SERIES in restricted, restricted


def test_a_worker_serves_its_metrics_on_the_socket_its_parent_bound() -> None:
    """--metrics-fd: the server adopts the inherited listening socket as it is (no bind of its
    own: its port is the parent's pick) and serves the registry there until it is shut down,
    which closes the socket."""
    registry = CollectorRegistry()
    Counter("kvpush_test_scrapes", "scrapes", registry=registry).inc(3)
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    server = serve_metrics(registry, "0.0.0.0", None, held.detach())  # the worker's now
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy
    try:
        assert server.server_address[:2] == ("127.0.0.1", port)
        with direct.open(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            status, text = response.status, response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200 and "kvpush_test_scrapes_total 3.0" in text, text
    assert server.socket.fileno() == -1  # closed with the server
