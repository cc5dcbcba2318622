"""The routed policy's decision in the gateway's trace and metrics, against fake workers (no
engine): each request's span carries the choice, its estimate, the candidates and the prefix
tokens matched; ``/metrics`` counts decisions by mode and reason and times them; the
dashboard's row of each request carries the decision too.

Threading model: the test's event loop (gateway and fake workers on it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvpush.schemas.messages import TransferMode
from tests.integration.gateway_fakes import Stack

StackFactory = Callable[..., Awaitable[Stack]]


async def test_each_decision_shows_in_the_span_and_the_metrics(
    stack: StackFactory, spans: Any
) -> None:
    s = await stack(local_threshold=8)
    await s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})  # cold: the threshold
    long_prompt = " ".join(["word"] * 20)
    await s.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 2, "kvpush_mode": "pull"})
    modes = [e.mode for e in s.decode.events]
    assert modes == [TransferMode.LOCAL, TransferMode.PULL]
    roots = [x for x in spans.get_finished_spans() if "kvpush.route.choice" in (x.attributes or {})]
    assert len(roots) == 2
    local, pull = sorted(roots, key=lambda x: x.start_time)
    d, p = s.decode.worker_id, s.prefill.worker_id
    assert local.attributes["kvpush.route.choice"] == f"local {d}"
    assert local.attributes["kvpush.route.reason"] == "cold"
    assert pull.attributes["kvpush.route.choice"] == f"pull {p}>{d}"
    assert pull.attributes["kvpush.route.reason"] == "override"
    assert pull.attributes["kvpush.route.estimate_ms"] > 0
    assert str(pull.attributes["kvpush.route.terms"]).startswith("handoff ")  # its terms
    assert str(pull.attributes["kvpush.route.candidates"]).startswith(f"pull {p}>{d} ")
    assert tuple(pull.attributes["kvpush.route.prefix_tokens"]) == (0, 0)  # no index here
    _, text = await s.call("GET", "/metrics")
    for line in (
        'kvpush_gateway_route_decisions_total{mode="local",reason="cold"} 1.0',
        'kvpush_gateway_route_decisions_total{mode="pull",reason="override"} 1.0',
        "kvpush_gateway_route_decision_seconds_count 2.0",
    ):
        assert line in text, line
    _, data = await s.call("GET", "/dashboard/data")
    rows = {r["mode"]: r for r in data["requests"]}
    assert rows["local"]["route_reason"] == "cold" and rows["local"]["prefill_id"] == ""
    assert rows["local"]["route_choice"] == f"local {d}" and rows["local"]["decode_id"] == d
    assert rows["pull"]["route_reason"] == "override" and rows["pull"]["prefill_id"] == p
    assert rows["pull"]["route_choice"] == f"pull {p}>{d}" and rows["pull"]["estimate_ms"] > 0
    assert rows["pull"]["prefix_tokens"] == [0, 0]
