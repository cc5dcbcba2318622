"""Engines on one device take turns on its compute (``device_share``): each worker's estimate
holds the queued compute of the other engines on its device, so a burst of cold prompts on a
2P2D fleet pinned to two cores (P0 and D0 on one core, P1 and D1 on the other, as ``kvpush up``
places them) is computed where no other engine's prefill waits."""

from __future__ import annotations

import pytest

from kvpush.schemas.messages import TransferMode, WorkerRole
from kvpush.services.gateway.cost_model import CostModel
from kvpush.services.gateway.device_share import others
from kvpush.services.gateway.routing import Router
from kvpush.services.gateway.worker_registry import WorkerRegistry
from tests.unit.beats import Clock, beat
from tests.unit.test_gateway_cost_model import (
    FakePrefix,
    local_timing,
    pushed,
    warm_up,
)

P, D = WorkerRole.PREFILL, WorkerRole.DECODE
LOCAL, PUSH = TransferMode.LOCAL, TransferMode.PUSH


def test_each_device_sums_its_engines_queues_and_a_worker_sees_the_others() -> None:
    model = CostModel()
    for name, took in (("p0", 10), ("d0", 100), ("d1", 300)):
        model.learn(LOCAL, None, name, 1000, cached_tokens=0, timing=local_timing(1, took))
    prefills = [("p0", 2, 50), ("p1", 1, 50)]  # p1 unmeasured: the fleet's service time
    decodes = [("d0", 1, 0, 50), ("d1", 4, 1, 50), ("d2", 1, 3, 50)]  # d2: none waiting
    sums = model.device_sums(prefills, ["h/cpu0", ""], decodes, ["h/cpu0", "h/cpu0", "h/cpu1"])
    assert sums == {"h/cpu0": pytest.approx(2 * 10 + 100 + 3 * 300)}  # p1 names no device
    assert others(sums, "h/cpu0", 2 * 10.0) == pytest.approx(100 + 900)
    assert others(sums, "h/cpu1", 0.0) == 0.0  # alone on its device
    assert others(sums, "", 5.0) == others(None, "h/cpu0", 5.0) == 0.0  # no device named
    parts = model.prefill_parts(prefills, ["h/cpu0", ""], sums)
    alone = model.prefill_parts(prefills)
    assert parts[0] == pytest.approx(alone[0] + 1000) and parts[1] == alone[1]


def two_core_fleet(devices: bool) -> Router:
    """2P2D, each engine prefilling 1000 tokens in 500 ms and a fast transfer; ``devices``:
    the heartbeats name the cores (P0, D0 on core 0; P1, D1 on core 1), else none."""
    registry = WorkerRegistry(lease_s=3.0, clock=Clock())
    for n in (0, 1):
        core = f"h/cpu{n}" if devices else ""
        registry.observe(beat(P, f"p{n}", sends_first_token=True, gpu=core))
        registry.observe(beat(D, f"d{n}", gpu=core))
    router = Router(registry, PUSH, 256, prefix=FakePrefix({}))
    warm_up(router.costs, tokens_per_ms=2)  # P: 500 ms for 1000 tokens
    for _ in range(40):  # 100 kB a token at 40 GB/s
        router.costs.observe_push(pushed(4000 * 100_000, 10.0, 4000))
    for name in ("d0", "d1"):  # D prefills alone as fast as P
        router.costs.learn(LOCAL, None, name, 1000, cached_tokens=0, timing=local_timing(1, 500))
    return router


def test_a_burst_of_cold_prompts_on_two_cores_is_computed_on_the_decode_workers() -> None:
    """Four cold prompts at once: priced by device, a push from P0 waits for D0's prefill on
    their shared core, so each D computes two, alone on its core (priced per engine, two were
    pushed by a P sharing a core with a busy D: the CPU routing benchmark's slowest requests)."""
    router = two_core_fleet(devices=True)
    routes = [router.route(list(range(1024))) for _ in range(4)]
    assert [r.mode for r in routes] == [LOCAL] * 4, [r.explanation for r in routes]
    assert sorted(r.decode_id for r in routes) == ["d0", "d0", "d1", "d1"]
    last = routes[-1].explanation
    assert last is not None and last.choice.terms["wait_d"] == pytest.approx(500.0)
    pushes = [e for e in last.alternatives if e.candidate.mode is PUSH]
    assert pushes and all(e.candidate.prefill_device_ms >= 500.0 for e in pushes)
    assert "device_d 0.0" in last.span_attributes()["kvpush.route.terms"]  # D's core: idle
    assert "wait_d 500.0" in last.span_attributes()["kvpush.route.terms"]  # one of its own


def test_without_devices_named_the_same_burst_is_pushed_in_part() -> None:
    """The control: the same fleet whose heartbeats name no device prices each engine alone,
    and pushes the third and fourth prompts (what the benchmark's slowest requests were)."""
    router = two_core_fleet(devices=False)
    routes = [router.route(list(range(1024))) for _ in range(4)]
    assert [r.mode for r in routes].count(PUSH) == 2, [r.explanation for r in routes]


def test_a_model_with_no_device_named_prices_as_before() -> None:
    model = CostModel()
    alone = model.prefill_parts([("p0", 2, 100)])
    assert model.prefill_parts([("p0", 2, 100)], [""], {}) == alone
    assert model.decode_parts(PUSH, [("d0", 2, 1, 100)], [""], {}) == model.decode_parts(
        PUSH, [("d0", 2, 1, 100)]
    )
