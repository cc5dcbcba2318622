"""The gateway's cost model (priors, learning) and the routed policy's choice over it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import pytest

from kvpush.schemas.messages import KvPushed, Timing, TransferMode, WorkerRole
from kvpush.services.gateway import cost_model
from kvpush.services.gateway.cost_model import Candidate, CostModel
from kvpush.services.gateway.route_choice import RouteReason
from kvpush.services.gateway.routing import Router, RoutingPolicy
from kvpush.services.gateway.worker_registry import WorkerRegistry, WorkerState
from tests.unit.beats import Clock, beat, others_on_device

P, D = WorkerRole.PREFILL, WorkerRole.DECODE
LOCAL, PUSH, PULL = TransferMode.LOCAL, TransferMode.PUSH, TransferMode.PULL
MS = 1_000_000  # ns


class FakePrefix:
    """A PrefixLookup whose answers the test sets: worker id -> matched tokens."""

    def __init__(self, hits: dict[str, int], block_size: int = 16) -> None:
        self.block_size = block_size
        self.hits = hits
        self.asked: list[list[str]] = []

    def matched_tokens(self, token_ids: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        listed = list(workers)
        self.asked.append(listed)
        return {w: min(self.hits[w], len(token_ids)) for w in listed if w in self.hits}


def local_timing(start_ms: int, took_ms: int) -> Timing:
    return Timing(decode_received=start_ms * MS, first_token=(start_ms + took_ms) * MS)


def push_timing(compute_ms: int, tail_ms: int = 1) -> Timing:
    """P computes from 10 ms for ``compute_ms``; the KV lands 1 ms after it is sent."""
    end = 10 + compute_ms
    return Timing(
        prefill_received=2 * MS,
        prefill_start=10 * MS,
        prefill_end=end * MS,
        kv_sent=(end + tail_ms) * MS,
        kv_landed=(end + tail_ms + 1) * MS,
        first_token=(end + tail_ms + 2) * MS,
    )


def pushed(bytes_: int, push_ms: float, tokens: int, timing: Timing | None = None) -> KvPushed:
    return KvPushed(
        transfer_id="t",
        prefill_id="p0",
        decode_id="d0",
        bytes=bytes_,
        descriptors=1,
        num_tokens=tokens,
        push_ms=push_ms,
        timing=timing,
    )


def warm_up(model: CostModel, tokens_per_ms: int = 10) -> None:
    """Enough measurements for the model to compare modes: 100-token prefills on p0 and a push
    of 1 MB per token at 1 GB/s."""
    for _ in range(cost_model.WARM_SAMPLES):
        model.learn(PUSH, "p0", "d0", 1000, timing=push_timing(1000 // tokens_per_ms))
    model.observe_push(pushed(1000 * 1_000_000, 1000.0, 1000))


def test_estimates_use_the_priors_before_any_measurement() -> None:
    model = CostModel()
    assert not model.warm
    local = model.estimate(Candidate(LOCAL, "d0", 2, 0, 4000))
    compute = 4000 * 1000.0 / cost_model.PRIOR_PREFILL_TOKENS_PER_S
    assert local.terms == {
        "overhead": cost_model.PRIOR_LOCAL_OVERHEAD_MS,
        "wait_d": 2 * cost_model.PRIOR_SERVICE_MS,
        "device_d": 0.0,  # no other engine on its device
        "decoding_d": 0.0,
        "compute_d": compute,
    }
    decoding = model.estimate(Candidate(LOCAL, "d0", 2, 0, 4000, decode_running=2))
    assert decoding.terms["wait_d"] == 0.0  # D's two requests decode: a step each, no queue
    assert decoding.terms["decoding_d"] == 2 * cost_model.PRIOR_STEP_MS
    assert local.total_ms == pytest.approx(sum(local.terms.values()))
    push = model.estimate(Candidate(PUSH, "d0", 0, 1000, 4000, "p0", 0, 0))
    transfer = (
        3000 * cost_model.PRIOR_BYTES_PER_TOKEN * 1000 / cost_model.PRIOR_TRANSFER_BYTES_PER_S
    )
    assert push.terms["transfer"] == pytest.approx(cost_model.PRIOR_PUSH_TAIL_SHARE * transfer)
    pull = model.estimate(Candidate(PULL, "d0", 0, 1000, 4000, "p0", 0, 0))
    assert pull.terms["transfer"] == pytest.approx(transfer)  # D reads it all after P's prefill
    assert push.terms["handoff"] == cost_model.PRIOR_HANDOFF_MS


def test_estimates_move_with_measurements() -> None:
    model = CostModel()
    before = model.estimate(Candidate(LOCAL, "d0", 0, 0, 1000)).total_ms
    model.learn(LOCAL, None, "d0", 1000, cached_tokens=0, timing=local_timing(1, 500))
    slow = model.estimate(Candidate(LOCAL, "d0", 0, 0, 1000))
    assert slow.terms["compute_d"] == pytest.approx(500.0) and slow.total_ms > before
    # a prefix hit the final chunk reports: only the computed tokens count for the rate
    model.learn(LOCAL, None, "d1", 1000, cached_tokens=900, timing=local_timing(1, 10))
    assert model.compute_ms("d1", 1000) == pytest.approx(100.0)
    # an unmeasured worker takes the fleet's mean, not the prior
    fleet = model.compute_ms("d9", 1000)
    assert fleet != pytest.approx(1000 * 1000.0 / cost_model.PRIOR_PREFILL_TOKENS_PER_S)
    # the wait term is load times the worker's measured first-step time
    assert model.wait_ms("d0", 3) == pytest.approx(3 * 500.0)


def test_pushes_teach_the_transfer_and_finished_pushes_the_rate_and_handoff() -> None:
    model = CostModel()
    prefill = Timing(prefill_end=100 * MS, kv_sent=150 * MS)
    model.observe_push(pushed(2_000_000, 100.0, 1000, prefill))  # 20 MB/s, 2 kB/token
    assert model.bytes_per_s.value == pytest.approx(20e6)
    assert model.bytes_per_token.value == pytest.approx(2000.0)
    assert model.push_tail_share.value == pytest.approx(0.5)
    assert model.transfer_ms(1000) == pytest.approx(100.0)
    assert not model.warm
    for _ in range(cost_model.WARM_SAMPLES):
        model.learn(
            PUSH, "p0", "d0", 1100, prefill_hit=100, timing=push_timing(50), published_ns=MS
        )
    assert model.warm
    assert model.compute_ms("p0", 1000) == pytest.approx(50.0)  # 1000 computed in 50 ms
    # hand-off: bus to P (1 ms) + kv_sent -> kv_landed (1 ms); D's first step apart
    assert model.handoff_ms.value == pytest.approx(2.0)
    assert model.steps_ms("d0", 2) == pytest.approx(3 * 1.0)
    # a pull teaches the transfer rate from D's READ (prefill_end -> kv_sent) of what D lacked
    model.learn(PULL, "p0", "d0", 1500, decode_hit=500, timing=push_timing(50, tail_ms=10))
    expected = 20e6 + cost_model.EWMA_WEIGHT * (200e6 - 20e6)  # 1000 x 2 kB in 10 ms
    assert model.bytes_per_s.value == pytest.approx(expected)


def test_a_local_request_that_queued_teaches_no_rate_nor_service_time() -> None:
    model = CostModel()
    model.learn(LOCAL, None, "d0", 1000, cached_tokens=0, timing=local_timing(1, 100))
    # 800 ms of it were a wait behind two prefills: wait_local charges those already
    waited = local_timing(1, 900)
    model.learn(LOCAL, None, "d0", 1000, cached_tokens=0, timing=waited, queued=2)
    assert model.compute_ms("d0", 1000) == pytest.approx(100.0)
    assert model.wait_ms("d0", 1) == pytest.approx(100.0)


def test_a_local_request_beside_decoding_ones_teaches_their_join_time_not_the_rate() -> None:
    """vLLM batches a prompt with D's running decodes: what they add is learned per running
    request (unmeasured, a step each), and the prefill rate stays the one measured alone."""
    model = CostModel()
    unmeasured = model.estimate(Candidate(LOCAL, "d0", 3, 0, 1000, decode_running=3))
    assert unmeasured.terms["decoding_d"] == pytest.approx(3 * cost_model.PRIOR_STEP_MS)
    model.learn(LOCAL, None, "d0", 1000, cached_tokens=0, timing=local_timing(1, 100))
    # beside 3 decoding requests the same prompt took 112 ms: 4 ms more per request
    model.learn(LOCAL, None, "d0", 1000, cached_tokens=0, timing=local_timing(1, 112), running=3)
    assert model.compute_ms("d0", 1000) == pytest.approx(100.0)
    assert model.wait_ms("d0", 1) == pytest.approx(100.0)
    assert model.view("d0").join_ms == pytest.approx(4.0)
    assert model.view("d1").join_ms == pytest.approx(4.0)  # unmeasured: the fleet's
    assert model.view("d0").step_ms == pytest.approx(cost_model.PRIOR_STEP_MS)
    busy = model.estimate(Candidate(LOCAL, "d0", 3, 0, 1000, decode_running=3))
    assert busy.terms["decoding_d"] == pytest.approx(12.0)
    assert busy.total_ms == pytest.approx(sum(busy.terms.values()))
    # faster than the compute alone (a cached prefix the index missed): a join of 0, not less
    model.learn(LOCAL, None, "d1", 1000, cached_tokens=0, timing=local_timing(1, 50), running=2)
    assert model.view("d1").join_ms == 0.0


def test_a_request_without_timing_teaches_nothing() -> None:
    model = CostModel()
    model.learn(PUSH, "p0", "d0", 100, timing=None)
    model.learn(LOCAL, None, "d0", 100, timing=Timing())
    assert not model.workers and model.fleet.tokens_per_s.samples == 0


@pytest.fixture
def registry() -> WorkerRegistry:
    registry = WorkerRegistry(lease_s=3.0, clock=Clock())
    for name in ("p0", "p1"):
        registry.observe(beat(P, name, sends_first_token=True))
    for name in ("d0", "d1", "d2"):
        registry.observe(beat(D, name))
    return registry


def routed(
    registry: WorkerRegistry, hits: dict[str, int] | None = None, **kwargs: object
) -> Router:
    prefix = FakePrefix(hits or {})
    return Router(registry, kwargs.pop("mode", PUSH), 256, prefix=prefix, **kwargs)  # type: ignore[arg-type]


def test_a_prefix_hit_on_one_decode_worker_wins(registry: WorkerRegistry) -> None:
    router = routed(registry, {"d2": 4096})
    route = router.route(list(range(4100)))
    assert route.decode_id == "d2"
    explained = route.explanation
    assert explained is not None and explained.reason is RouteReason.COLD  # an idle D: LOCAL
    assert route.mode is LOCAL and explained.decode_prefix_tokens == 4096
    warm_up(router.costs)
    route = router.route(list(range(4100)))
    assert route.decode_id == "d2" and route.mode is LOCAL  # D has it: 4 tokens to compute
    assert route.explanation is not None and route.explanation.reason is RouteReason.COST
    assert route.explanation.decode_prefix_tokens == 4096
    assert route.explanation.alternatives  # the runners-up, dearer than the choice
    assert all(
        a.total_ms >= route.explanation.choice.total_ms for a in route.explanation.alternatives
    )


def test_while_cold_an_idle_decode_worker_computes_a_long_prompt_and_a_busy_one_does_not(
    registry: WorkerRegistry,
) -> None:
    router = routed(registry)
    route = router.route(list(range(4100)))  # over --local-threshold, but D waits for nothing
    assert route.mode is LOCAL and route.explanation is not None
    assert route.explanation.reason is RouteReason.COLD
    for name in ("d0", "d1", "d2"):
        registry.observe(beat(D, name, in_flight=1))
    route = router.route(list(range(4100)))  # every D busy: the fixed rule's push
    assert route.mode is PUSH and route.explanation is not None
    assert route.explanation.reason is RouteReason.COLD
    assert router.route(list(range(100))).mode is LOCAL  # under the threshold: LOCAL
    for _ in range(cost_model.WARM_SAMPLES):  # D's prefills alone warm it (transfer: prior)
        router.costs.learn(LOCAL, None, "d0", 4100, cached_tokens=0, timing=local_timing(1, 400))
    assert router.costs.warm and router.costs.bytes_per_s.samples == 0
    never = Router(registry, PUSH, 0, prefix=FakePrefix({}))  # 0: never LOCAL unasked
    registry.observe(beat(D, "d0"))
    assert never.route(list(range(4100))).mode is PUSH


def test_while_cold_a_p_on_a_d_s_gpu_is_not_pushed_to(registry: WorkerRegistry) -> None:
    """On one GPU a cold push saves nothing (P's prefill takes turns with D's) and adds the
    hand-off: while cold, every prompt is LOCAL there; a P on a GPU of its own still pushes."""
    router = routed(registry)
    for name in ("p0", "p1"):
        registry.observe(beat(P, name, sends_first_token=True, gpu="h/gpu0"))
    for name in ("d0", "d1", "d2"):
        registry.observe(beat(D, name, in_flight=1, gpu="h/gpu0"))  # busy: not the idle rule
    route = router.route(list(range(4100)))
    assert route.mode is LOCAL and route.explanation is not None
    assert route.explanation.reason is RouteReason.COLD
    registry.observe(beat(P, "p1", sends_first_token=True, gpu="h/gpu1"))  # a GPU of its own
    assert router.route(list(range(4100))).mode is PUSH
    never = Router(registry, PUSH, 0, prefix=FakePrefix({}))  # 0: never LOCAL unasked
    registry.observe(beat(P, "p1", sends_first_token=True, gpu="h/gpu0"))
    assert never.route(list(range(4100))).mode is PUSH


def test_a_p_on_d_s_own_gpu_takes_turns_with_d_s_waiting_prefills(
    registry: WorkerRegistry,
) -> None:
    """On one GPU P's prefill does not overlap D's queued ones: a push pays them in full."""
    router = routed(registry)
    warm_up(router.costs, tokens_per_ms=10)  # 4000 tokens: 400 ms on P
    for _ in range(40):  # a fast transfer: 100 kB a token at 40 GB/s
        router.costs.observe_push(pushed(4000 * 100_000, 10.0, 4000))
    for _ in range(3):  # D prefills alone 4000 tokens in 400 ms too
        router.costs.learn(LOCAL, None, "d0", 4000, timing=local_timing(1, 400))
    for name in ("d1", "d2"):
        registry.observe(beat(D, name, in_flight=8, queue_depth=8))  # far busier
    registry.observe(beat(D, "d0", in_flight=1, queue_depth=1))  # one prefill queued
    apart = router.route(list(range(4000)))
    assert apart.mode is PUSH and apart.decode_id == "d0"  # it overlaps D's queued prefill
    assert apart.explanation is not None
    assert apart.explanation.choice.terms["wait_d"] == 0.0
    for name in ("p0", "p1"):
        registry.observe(beat(P, name, sends_first_token=True, gpu="h/gpu0"))
    for name, queued in (("d0", 1), ("d1", 8), ("d2", 8)):  # the same load, on that GPU
        registry.observe(beat(D, name, in_flight=queued, queue_depth=queued, gpu="h/gpu0"))
    shared = router.route(list(range(4000)))
    assert shared.explanation is not None
    assert shared.mode is LOCAL, shared.explanation  # in turns the push is no cheaper
    pushes = [e for e in shared.explanation.alternatives if e.candidate.mode is PUSH]
    assert pushes and all(e.candidate.shared_gpu for e in pushes)
    assert all(e.candidate.label.endswith(" (one device)") for e in pushes)  # the trace says so
    for found in pushes:  # the O(P + D) totals and the full estimate agree
        full = router.costs.estimate(found.candidate)
        assert full.total_ms == pytest.approx(found.total_ms)
        # D's queued prefills are P's device's queue, not a wait past P's part
        assert full.terms["wait_d"] == 0.0 and full.terms["device_p"] >= 400.0


def test_a_long_prompt_with_an_idle_prefill_worker_goes_push(registry: WorkerRegistry) -> None:
    router = routed(registry)
    warm_up(router.costs, tokens_per_ms=10)
    router.costs.learn(LOCAL, None, "d0", 1000, timing=local_timing(1, 100))  # D as fast as P
    router.costs.observe_push(pushed(1000 * 1000, 1000.0, 1000))  # 1 kB/token at 1 MB/s...
    for _ in range(20):
        router.costs.observe_push(pushed(1000 * 1000, 1.0, 1000))  # ... then 1 GB/s
    for name in ("d0", "d1", "d2"):  # D busy with a prefill: P's compute is off it
        registry.observe(beat(D, name, in_flight=1, queue_depth=1))
    route = router.route(list(range(8000)))
    assert route.mode is PUSH and route.prefill_id in ("p0", "p1") and route.prefill_epoch == 1
    assert route.explanation is not None and route.explanation.reason is RouteReason.COST
    assert route.explanation.choice.candidate.label.startswith("push ")
    assert route.prefill_sends_first_token


def test_a_push_waits_for_the_prefills_queued_on_its_decode_worker(
    registry: WorkerRegistry,
) -> None:
    """D runs its queued LOCAL prefills before a pushed request's first step: a push to it costs
    their time where it is more than P's work (a step each, as before, d0 and d2 looked as
    cheap as d1 and the push estimate was under its TTFT)."""
    router = routed(registry)
    warm_up(router.costs, tokens_per_ms=10)  # P: 100 ms for 1000 tokens
    for name in ("d0", "d1", "d2"):  # D: 800 ms a prefill of 1000 tokens
        router.costs.learn(LOCAL, None, name, 1000, timing=local_timing(1, 800))
    registry.observe(beat(D, "d0", in_flight=2, queue_depth=2))  # two prefills queued
    registry.observe(beat(D, "d1", in_flight=3))  # three answers decoding
    registry.observe(beat(D, "d2", in_flight=2, queue_depth=2))
    route = router.route(list(range(1000)))
    assert route.explanation is not None
    assert (route.mode, route.decode_id) == (PUSH, "d1"), route.explanation
    terms = route.explanation.choice.terms
    assert terms["wait_d"] == 0.0 and terms["steps_d"] == pytest.approx(4 * 1.0)
    queued = [
        found
        for found in route.explanation.alternatives
        if found.candidate.mode is PUSH and found.candidate.decode_id in ("d0", "d2")
    ]
    assert queued and all(found.total_ms >= 2 * 800.0 for found in queued)
    for found in (route.explanation.choice, *route.explanation.alternatives):
        full = router.costs.estimate(found.candidate)
        assert full.total_ms == pytest.approx(found.total_ms), found
        assert full.total_ms == pytest.approx(sum(full.terms.values()))
        if found in queued:  # the wait past P's part is a term of its own
            assert full.terms["wait_d"] > 0


def test_a_decode_worker_busy_decoding_still_computes_a_prompt_it_mostly_holds(
    registry: WorkerRegistry,
) -> None:
    """Decoding requests cost a LOCAL prompt a step each, not a prefill each: vLLM batches the
    prompt with them (charged a service time each, a D streaming answers looked queued)."""
    router = routed(registry, {"d0": 7936, "d1": 7936, "d2": 7936, "p0": 7936, "p1": 7936})
    warm_up(router.costs, tokens_per_ms=10)
    for _ in range(5):  # a prefill takes D 800 ms of service; a step 5 ms
        router.costs.learn(LOCAL, None, "d0", 8000, timing=local_timing(1, 800))
    for name in ("d0", "d1", "d2"):
        registry.observe(beat(D, name, in_flight=4))  # four answers streaming on each D
    route = router.route(list(range(8000)))
    assert route.mode is LOCAL, route.explanation
    assert route.explanation is not None
    terms = route.explanation.choice.terms
    assert terms["wait_d"] == 0.0 and terms["decoding_d"] > 0
    assert route.explanation.choice.candidate.decode_running == 4
    for found in (route.explanation.choice, *route.explanation.alternatives):
        # the O(P + D) parts and the full estimate add up the same terms
        again = router.costs.estimate(found.candidate).total_ms
        assert again == pytest.approx(found.total_ms), found


def test_a_queued_request_counts_once_in_a_worker_s_load(registry: WorkerRegistry) -> None:
    registry.observe(beat(D, "d0", in_flight=2, queue_depth=1))  # one prefilling, one decoding
    (d0,) = [s for s in registry.alive(D) if s.heartbeat.worker_id == "d0"]
    assert (d0.load, d0.running) == (2, 1)
    router = routed(registry, {"d0": 4096})
    warm_up(router.costs)
    route = router.route(list(range(4000)))
    assert route.mode is LOCAL and route.decode_id == "d0" and route.explanation is not None
    terms, view = route.explanation.choice.terms, router.costs.view("d0")
    assert terms["wait_d"] == pytest.approx(view.service_ms)  # one prefill ahead, not two
    assert terms["decoding_d"] == pytest.approx(view.step_ms)


def test_a_request_that_ended_leaves_d_s_load_before_its_next_heartbeat(
    registry: WorkerRegistry,
) -> None:
    """One request at a time: a heartbeat read while the previous one decoded, or none read
    since it was sent, must not make an idle D look busy (its LOCAL estimate charged a wait)."""
    router = routed(registry, {"d0": 4096})
    warm_up(router.costs)
    (d0,) = [s for s in registry.alive(D) if s.heartbeat.worker_id == "d0"]
    first = router.route(list(range(4000)))
    assert first.decode_id == "d0" and d0.load == 1
    registry.observe(beat(D, "d0", in_flight=1))  # the beat counts it, decoding
    router.ended(first, started=True)  # the gateway saw its last chunk: the beat is stale
    assert (d0.load, d0.running) == (0, 0)
    second = router.route(list(range(4000)))
    assert second.explanation is not None
    terms = second.explanation.choice.terms
    assert terms["wait_d"] == 0.0 and terms["decoding_d"] == 0.0
    router.learn(second, 4000, 3999, local_timing(1, 3))  # nothing queued: D's rate learns
    assert router.costs.workers["d0"].service_ms.samples == 1
    router.ended(second, started=True)  # no beat read since it was sent
    assert d0.load == 0 and d0.sent_since_heartbeat == 0
    registry.observe(beat(D, "d0"))  # the next beat resets what ended since the last
    assert d0.ended_since_heartbeat == 0 and d0.load == 0
    stale = dataclasses.replace(first, decode_epoch=first.decode_epoch + 1)
    router.ended(stale, started=True)  # another epoch of d0's route ends nothing of this one
    assert d0.ended_since_heartbeat == 0


def test_what_the_gateway_saw_since_a_heartbeat_moves_requests_from_waiting_to_running(
    registry: WorkerRegistry,
) -> None:
    """A LOCAL request waits for D's prefill until its first token (then a step each), a push
    request on D never does (its KV comes from P), whether the heartbeat counts it or not."""
    router = routed(registry, {"d0": 4096})
    warm_up(router.costs)
    (d0,) = [s for s in registry.alive(D) if s.heartbeat.worker_id == "d0"]
    local = router.route(list(range(4000)))
    assert local.mode is LOCAL and local.decode_id == "d0"
    assert (d0.load, d0.waiting, d0.running) == (1, 1, 0)  # sent since the beat: waiting
    router.started(local)  # its first token: running
    assert (d0.load, d0.waiting, d0.running) == (1, 0, 1)
    pushed = router.route(list(range(4000)), PUSH)
    assert pushed.decode_id == "d0", pushed
    assert (d0.load, d0.waiting, d0.running) == (2, 0, 2)  # waits for P's KV, not for D
    registry.observe(beat(D, "d0", in_flight=2, queue_depth=1))  # a beat from before it started
    assert (d0.load, d0.waiting, d0.running) == (2, 1, 1)
    router.started(local)  # after the beat: what it counts as queued runs now
    assert (d0.load, d0.waiting, d0.running) == (2, 0, 2)
    router.ended(local, started=True)
    router.ended(pushed, started=False)
    assert (d0.load, d0.waiting, d0.running) == (0, 0, 0)
    failed = router.route(list(range(4000)))  # a LOCAL request that failed before its start
    router.ended(failed, started=False)
    assert (d0.load, d0.sent_since_heartbeat, d0.sent_running) == (0, 0, 0)


def test_a_short_prompt_goes_local_and_a_pull_deployment_offers_pull(
    registry: WorkerRegistry,
) -> None:
    router = routed(registry, mode=PULL)
    warm_up(router.costs)
    route = router.route(list(range(300)))  # above --local-threshold: the cold rule said pull
    assert route.mode is LOCAL and route.prefill_epoch is None
    labels = [e.candidate.label for e in route.explanation.alternatives]  # type: ignore[union-attr]
    assert any(label.startswith("pull ") for label in labels)
    assert not any(label.startswith("push ") for label in labels)


def test_the_override_wins_and_prefill_is_asked_only_when_a_transfer_may_be_chosen(
    registry: WorkerRegistry,
) -> None:
    router = routed(registry, {"d1": 4096})
    warm_up(router.costs)
    route = router.route(list(range(4100)), PUSH)
    assert route.mode is PUSH and route.explanation is not None
    assert route.explanation.reason is RouteReason.OVERRIDE
    assert route.decode_id == "d1"  # less to push to d1
    prefix = router.prefix
    assert isinstance(prefix, FakePrefix) and {"p0", "p1"} <= set(prefix.asked[-1])
    route = router.route(list(range(10)), LOCAL)
    assert route.mode is LOCAL and set(prefix.asked[-1]) == {"d0", "d1", "d2"}


def test_loads_tie_break_as_least_loaded_and_sent_requests_count(
    registry: WorkerRegistry,
) -> None:
    router = routed(registry)
    registry.observe(beat(D, "d0", in_flight=2))
    registry.observe(beat(D, "d1", free_blocks=10))
    picks = [router.route(list(range(300))).decode_id for _ in range(3)]
    assert picks == ["d2", "d1", "d2"]  # d2 has more free blocks; then what was sent counts


def test_no_prefill_worker_means_only_local(registry: WorkerRegistry) -> None:
    registry = WorkerRegistry(lease_s=3.0, clock=Clock())
    registry.observe(beat(D, "d0"))
    route = routed(registry).route(list(range(1000)))
    assert route.mode is LOCAL and route.prefill_id == "_"
    assert route.explanation is not None and route.explanation.reason is RouteReason.ONLY_LOCAL


def test_least_loaded_policy_is_todays_rule_whatever_the_costs(registry: WorkerRegistry) -> None:
    router = routed(registry, {"d2": 4096}, routing=RoutingPolicy.LEAST_LOADED)
    warm_up(router.costs)
    route = router.route(list(range(4100)))
    assert route.mode is PUSH and route.decode_id == "d0" and route.explanation is None
    assert router.route(list(range(255))).mode is LOCAL  # below --local-threshold
    assert router.route(300, LOCAL).mode is LOCAL
    assert not router.prefix.asked  # type: ignore[union-attr]


def test_the_router_learns_from_a_finished_route(registry: WorkerRegistry) -> None:
    router = routed(registry, {"p0": 512, "p1": 512})
    route = router.route(list(range(1024)), PUSH)
    assert route.mode is PUSH and route.explanation is not None
    assert route.explanation.prefill_prefix_tokens == 512
    router.learn(route, 1024, None, push_timing(51))
    assert router.costs.compute_ms(route.prefill_id, 512) == pytest.approx(51.0)


def test_the_router_teaches_a_local_route_s_join_time_from_d_s_running_requests(
    registry: WorkerRegistry,
) -> None:
    registry.observe(beat(D, "d0", in_flight=2))  # two answers decoding, none queued
    router = routed(registry, {"d0": 4096})
    warm_up(router.costs)
    route = router.route(list(range(4000)))
    assert route.mode is LOCAL and route.decode_id == "d0" and route.explanation is not None
    assert route.explanation.choice.candidate.decode_running == 2
    router.learn(route, 4000, 3999, local_timing(1, 9))
    d0 = router.costs.workers["d0"]
    assert (d0.join_ms.samples, d0.service_ms.samples) == (1, 0)


def test_a_zero_local_threshold_still_means_never_local_unasked(registry: WorkerRegistry) -> None:
    prefix = FakePrefix({"d2": 4096})
    router = Router(registry, PUSH, 0, prefix=prefix)
    warm_up(router.costs)
    route = router.route(list(range(4100)))  # LOCAL on d2 would be cheapest: not a candidate
    assert route.mode is PUSH and route.decode_id == "d2"
    assert route.explanation is not None and route.explanation.reason is RouteReason.COST
    assert all(not e.candidate.label.startswith("local") for e in route.explanation.alternatives)
    assert router.route(list(range(4100)), LOCAL).mode is LOCAL


def test_routing_flag_defaults_to_routed_and_reads_the_environment() -> None:
    import argparse

    from kvpush.services.gateway import GatewayConfig, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert GatewayConfig.from_args(args, {}).routing is RoutingPolicy.ROUTED
    env = {"KVPUSH_ROUTING": "least-loaded"}
    assert GatewayConfig.from_args(args, env).routing is RoutingPolicy.LEAST_LOADED
    flagged = parser.parse_args(["--model", "m", "--routing", "least-loaded"])
    assert GatewayConfig.from_args(flagged, {}).routing is RoutingPolicy.LEAST_LOADED


# (role, gpu, requests queued for a prefill, requests running) per worker
SHARED_GPU_FLEETS = [
    # the cheapest P shares d0's GPU and d0 is queued; P elsewhere is dearer alone
    [(P, "g0", 0, 0), (P, "g1", 1, 0), (D, "g0", 3, 0)] + [(D, "g2", 0, 5)] * 4,
    # four P on d0's GPU rank before the one elsewhere
    [(P, "g0", 0, 0)] * 4 + [(P, "g1", 1, 0), (D, "g0", 3, 0)],
]


@pytest.mark.parametrize("fleet", [*SHARED_GPU_FLEETS, *range(60)])
def test_the_cheapest_pair_is_found_when_some_workers_share_a_gpu(
    fleet: list[tuple[WorkerRole, str, int, int]] | int,
) -> None:
    """Against every (P, D) pair's full estimate: a P and a D on one GPU take turns, so the
    cheapest pair may be a P on another GPU, ranked past the cheapest few P."""
    import random

    from kvpush.services.gateway.route_choice import choose

    if isinstance(fleet, int):  # a random fleet of up to 8 P and 8 D on 3 GPUs and CPUs
        rng = random.Random(fleet)
        fleet = [
            (role, rng.choice(["", "g0", "g1", "g2"]), rng.randrange(4), rng.randrange(6))
            for role in (P, D)
            for _ in range(rng.randrange(1, 9))
        ]
    registry = WorkerRegistry(lease_s=3.0, clock=Clock())
    for n, (role, gpu, queued, running) in enumerate(fleet):
        in_flight = queued + (running if role is D else 0)
        registry.observe(
            beat(role, f"{role.value[0]}{n}", in_flight=in_flight, queue_depth=queued, gpu=gpu)
        )
    model = CostModel()
    warm_up(model)
    decodes, prefills = registry.alive(D), registry.alive(P)
    picked = choose(model, 1000, {}, decodes, prefills, (PUSH,))
    gpu_of = {s.worker_id: s.heartbeat.gpu for s in (*decodes, *prefills)}

    def shared(p: str, d: str) -> bool:
        return bool(gpu_of[p]) and gpu_of[p] == gpu_of[d]

    def device(state: WorkerState) -> float:  # the others' queued compute on its device
        return others_on_device(model, prefills, decodes, state)

    best = min(
        model.estimate(
            Candidate(
                PUSH,
                d.worker_id,
                d.load,
                0,
                1000,
                p.worker_id,
                p.load,
                0,
                decode_running=d.running,
                shared_gpu=shared(p.worker_id, d.worker_id),
                prefill_device_ms=device(p),
                decode_device_ms=device(d),
            )
        ).total_ms
        for d in decodes
        for p in prefills
    )
    assert picked.choice.total_ms == pytest.approx(best)
    chosen = picked.choice.candidate
    assert chosen.prefill_id is not None
    assert chosen.shared_gpu == shared(chosen.prefill_id, chosen.decode_id)
    labels = [e.candidate.label for e in (picked.choice, *picked.alternatives)]
    assert len(labels) == len(set(labels))  # no pair twice
