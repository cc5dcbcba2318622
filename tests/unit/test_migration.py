"""services/gateway/migration.py: what a request keeps to move, when it may, what it still owes."""

from __future__ import annotations

from kvpush.schemas.messages import SequenceOutput, TokenChunk, TransferMode
from kvpush.schemas.messages import WorkerRole as R
from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.gateway.migration import Lost, Migration
from kvpush.services.gateway.routing import Router
from kvpush.services.gateway.worker_registry import WorkerRegistry
from tests.unit.beats import beat


def chunk(ids: list[int], outputs: list[SequenceOutput] | None = None) -> TokenChunk:
    return TokenChunk("r", "t", 0, ids, "x", outputs=outputs)


def test_a_move_asks_for_what_is_still_owed() -> None:
    migration = Migration(3, SamplingSpec(max_tokens=10, min_tokens=4), reconnects=0)
    migration.record(chunk([5, 6]))
    migration.record(chunk([], [SequenceOutput(token_ids=[7])]))
    extra, owed = migration.moved(reconnects=2)
    assert extra == [5, 6, 7] and owed.max_tokens == 7 and owed.min_tokens == 1
    assert migration.count == 1 and migration.tokens_before == 3 and migration.reconnects == 2


def test_what_may_not_move() -> None:
    assert Migration(1, SamplingSpec(), 0).movable()
    assert not Migration(0, SamplingSpec(), 0).movable()  # --migration-limit 0
    assert not Migration(3, SamplingSpec(n=2), 0).movable()
    assert not Migration(3, SamplingSpec(prompt_logprobs=1), 0).movable()
    stops = Migration(3, SamplingSpec(stop=["x"]), 0)
    assert stops.movable()  # nothing sent yet: nothing held back
    stops.record(chunk([1]))
    assert not stops.movable()
    done = Migration(3, SamplingSpec(max_tokens=1), 0)
    done.record(chunk([1]))
    assert not done.movable()
    for spec in (SamplingSpec(presence_penalty=0.5), SamplingSpec(temperature=1.0, seed=7)):
        shaped = Migration(3, spec, 0)  # the new D would read the answer so far as prompt
        assert shaped.movable()
        shaped.record(chunk([1]))
        assert not shaped.movable(), spec
    counted = Migration(3, SamplingSpec(min_tokens=5, logprobs=2), 0)
    counted.record(chunk([1]))
    assert counted.movable()  # min_tokens is owed less what was sent; logprobs come anew


def test_what_was_lost() -> None:
    registry = WorkerRegistry()
    registry.observe(beat(R.PREFILL, "p"))
    registry.observe(beat(R.DECODE, "d"))
    router = Router(registry, TransferMode.PUSH, 0)
    route = router.route(10)
    migration = Migration(3, SamplingSpec(), reconnects=0)
    assert migration.lost(router, route, answered=False, reconnects=0) is None
    assert migration.lost(router, route, answered=False, reconnects=1) is Lost.BUS
    migration.delivered(reconnects=1)  # a chunk came in order after the break: nothing lost
    assert migration.lost(router, route, answered=False, reconnects=1) is None
    registry.observe(beat(R.PREFILL, "p", epoch=2))
    assert migration.lost(router, route, answered=False, reconnects=1) is Lost.PREFILL
    assert migration.lost(router, route, answered=True, reconnects=1) is None  # D has all
    registry.observe(beat(R.DECODE, "d", epoch=2))
    assert migration.lost(router, route, answered=True, reconnects=1) is Lost.DECODE


def test_with_nowhere_to_move_only_a_bus_break_waits_and_not_for_ever() -> None:
    migration = Migration(3, SamplingSpec(), 0)
    assert not migration.waits(Lost.DECODE, 10.0, bus_broke=False, bus_grace_s=6.0)
    assert migration.waits(Lost.PREFILL, 10.0, bus_broke=False, bus_grace_s=6.0)
    assert migration.waits(Lost.BUS, 11.0, bus_broke=False, bus_grace_s=6.0)
    assert migration.waits(Lost.DECODE, 15.9, bus_broke=True, bus_grace_s=6.0)
    assert not migration.waits(Lost.DECODE, 16.1, bus_broke=True, bus_grace_s=6.0)


def test_a_lost_prefill_waits_for_decodes_own_fallback_only_for_its_grace() -> None:
    """D computes the prompt itself once it finds P dead; a stopped P is not found dead (D
    keeps its blocks), so past the grace the request stops waiting (and moves to LOCAL)."""
    migration = Migration(3, SamplingSpec(), 0)
    assert migration.waits(Lost.PREFILL, 10.0, bus_broke=False, bus_grace_s=9.0)
    assert migration.waits(Lost.PREFILL, 18.9, bus_broke=False, bus_grace_s=9.0)
    assert not migration.waits(Lost.PREFILL, 19.1, bus_broke=False, bus_grace_s=9.0)
    migration.delivered(reconnects=0)  # a chunk came: the wait starts again at the next loss
    assert migration.waits(Lost.PREFILL, 30.0, bus_broke=False, bus_grace_s=9.0)
