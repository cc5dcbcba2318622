"""The soak's killer plan: kinds in rounds, random victims, one nats-server restart per run."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from kvpush.benchmarks.soak import faults
from kvpush.benchmarks.soak.faults import FaultPlan, Killer, check_kinds, stop_seconds

KINDS = ("kill_prefill", "kill_decode", "stop_prefill", "stop_decode", "restart_nats")
WORKERS = {"prefill": ["soak-p0", "soak-p1"], "decode": ["soak-d0", "soak-d1"]}


def plan(seed: int = 0, kinds: tuple[str, ...] = KINDS, load_s: float = 1800.0) -> FaultPlan:
    return FaultPlan(kinds, WORKERS, random.Random(seed), load_s)


def play(p: FaultPlan, faults: int, every_s: float) -> list[tuple[str, str]]:
    return [p.next(i * every_s, i == faults - 1) for i in range(faults)]


def test_nats_restarts_once_and_every_other_kind_gets_its_turn_on_its_roles_workers() -> None:
    played = play(plan(), 24, 75.0)
    kinds = Counter(kind for kind, _ in played)
    assert kinds["restart_nats"] == 1
    assert all(kinds[k] >= 5 for k in KINDS if k != "restart_nats")
    for kind, victim in played:
        role = kind.partition("_")[2]
        assert victim in WORKERS[role] if role in WORKERS else victim == ""
    victims = Counter(victim for _, victim in played)
    assert set(victims) == {"", *WORKERS["prefill"], *WORKERS["decode"]}


def test_nats_restarts_between_a_fifth_and_three_fifths_of_the_load() -> None:
    for seed in range(20):
        played = play(plan(seed), 24, 75.0)
        at = next(i for i, (kind, _) in enumerate(played) if kind == "restart_nats") * 75.0
        assert 0.2 * 1800 <= at <= 0.6 * 1800 + 75.0


def test_a_short_run_still_restarts_nats_at_its_last_fault() -> None:
    played = play(plan(load_s=100_000.0), 3, 20.0)
    assert [kind for kind, _ in played].count("restart_nats") == 1
    assert played[-1][0] == "restart_nats"


def test_a_seed_gives_the_same_sequence() -> None:
    assert play(plan(7), 12, 60.0) == play(plan(7), 12, 60.0)
    assert play(plan(7), 12, 60.0) != play(plan(8), 12, 60.0)


def test_without_nats_in_the_set_it_never_restarts() -> None:
    played = play(plan(kinds=("kill_decode", "burst")), 6, 60.0)
    assert {kind for kind, _ in played} == {"kill_decode", "burst"}


def test_unknown_kinds_and_stacks_without_a_victim_are_refused() -> None:
    check_kinds(KINDS, 1, 1)
    with pytest.raises(ValueError):
        check_kinds(("kill_gateway",), 2, 2)
    with pytest.raises(ValueError):
        check_kinds((), 2, 2)
    with pytest.raises(ValueError):
        check_kinds(KINDS, 0, 2)


def test_a_stopped_worker_stays_stopped_well_past_its_lease() -> None:
    assert stop_seconds(1.5) > 2 * 1.5


class FakeStack:
    """What ``Killer`` needs of ``SoakStack``: the gateway's epochs, kills, stops, answers."""

    def __init__(self, comes_back: bool = True) -> None:
        self.epochs: dict[str, int | None] = {"soak-d0": 1}
        self.watch = SimpleNamespace(served={})
        self.comes_back = comes_back
        self.restarts = 0

    def gateway_epoch(self, worker_id: str) -> int | None:
        return self.epochs[worker_id]

    def lease_s(self, worker_id: str) -> float:
        return 0.01

    async def _gone_then_back(self, worker_id: str, seconds: float) -> None:
        await asyncio.sleep(0.05)
        self.epochs[worker_id] = None  # its lease ran out at the gateway
        await asyncio.sleep(seconds)
        if self.comes_back:
            self.epochs[worker_id] = 2
            asyncio.get_running_loop().call_later(0.05, self._answered, worker_id)

    def _answered(self, worker_id: str) -> None:
        self.watch.served[worker_id] = time.monotonic()

    async def kill(self, worker_id: str) -> None:
        await self._gone_then_back(worker_id, 0.1)

    async def pause(self, worker_id: str, seconds: float) -> None:
        await self._gone_then_back(worker_id, 0.0)

    async def restart_nats(self) -> None:
        self.restarts += 1


@pytest.mark.parametrize("kind", ["kill_decode", "stop_decode"])
async def test_a_fault_is_timed_from_its_signal_to_gone_alive_and_served_again(kind: str) -> None:
    played = await Killer(FakeStack()).play(kind, "soak-d0")  # type: ignore[arg-type]
    assert played.detect_s is not None and played.rejoin_s is not None
    assert played.detect_s <= played.rejoin_s and played.back is not None
    await asyncio.wait([played.back], timeout=10.0)  # its first answer, before its window ends
    back = await played.close()
    assert back is not None and back >= played.rejoin_s


async def test_a_victim_that_never_serves_again_is_not_timed() -> None:
    stack = FakeStack()
    played = await Killer(stack).play("kill_decode", "soak-d0")  # type: ignore[arg-type]
    stack.watch.served.clear()
    assert played.back is not None
    played.back.cancel()  # as if the fault's window ended before the victim's first answer
    assert await played.close() is None


async def test_a_victim_the_gateway_never_counts_alive_again_stops_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(faults, "REJOIN_LIMIT_S", 0.2)
    with pytest.raises(RuntimeError, match="not alive again"):
        await Killer(FakeStack(comes_back=False)).play("kill_decode", "soak-d0")  # type: ignore[arg-type]


async def test_a_nats_restart_has_no_victim_to_time() -> None:
    stack = FakeStack()
    played = await Killer(stack).play("restart_nats", "")  # type: ignore[arg-type]
    assert stack.restarts == 1 and played.detect_s is None and await played.close() is None
