"""Gateway routing and config: leases, draining, least-loaded choice, modes, flags and env."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvpush.schemas.messages import TransferMode, WorkerRole
from kvpush.services.gateway import ConfigError, GatewayConfig, add_arguments
from kvpush.services.gateway.routing import DECODE_ONLY, Router
from kvpush.services.gateway.worker_registry import NoWorkerError, WorkerRegistry
from tests.unit.beats import Clock, beat

P, D = WorkerRole.PREFILL, WorkerRole.DECODE


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> WorkerRegistry:
    return WorkerRegistry(lease_s=3.0, clock=clock)


def test_workers_live_while_heartbeats_arrive_within_the_lease(
    registry: WorkerRegistry, clock: Clock
) -> None:
    registry.observe(beat(D, "d0"))
    clock.now += 2.9
    assert registry.counts() == {"prefill": 0, "decode": 1}
    registry.observe(beat(D, "d0"))
    clock.now += 2.9
    assert registry.epoch(D, "d0") == 1
    clock.now += 0.2
    assert registry.epoch(D, "d0") is None
    assert registry.counts()["decode"] == 0 and registry.stats.expired == 1


def test_draining_workers_get_no_new_work_but_stay_alive(registry: WorkerRegistry) -> None:
    registry.observe(beat(D, "d0", draining=True))
    assert registry.counts()["decode"] == 0
    assert registry.epoch(D, "d0") == 1  # its in-flight requests are not failed
    with pytest.raises(NoWorkerError):
        registry.pick(D)


def test_decode_choice_is_least_loaded_then_most_free_blocks(registry: WorkerRegistry) -> None:
    registry.observe(beat(D, "busy", in_flight=3))
    registry.observe(beat(D, "queued", in_flight=2, queue_depth=2))  # queue_depth is in in_flight
    registry.observe(beat(D, "idle", free_blocks=10))
    registry.observe(beat(D, "roomy", free_blocks=90))
    assert registry.pick(D).heartbeat.worker_id == "roomy"
    assert registry.pick(D).heartbeat.worker_id == "idle"  # roomy now has one sent to it
    picks = [registry.pick(D).heartbeat.worker_id for _ in range(4)]
    assert picks == ["roomy", "idle", "queued", "roomy"]  # busy (3 in flight) never
    registry.observe(beat(D, "roomy", free_blocks=90))  # a heartbeat resets the local count
    assert registry.pick(D).heartbeat.worker_id == "roomy"


def test_a_new_epoch_means_restart_and_old_heartbeats_are_ignored(
    registry: WorkerRegistry,
) -> None:
    registry.observe(beat(D, "d0", epoch=2))
    registry.observe(beat(D, "d0", epoch=1, draining=True))
    assert registry.epoch(D, "d0") == 2 and registry.counts()["decode"] == 1
    registry.observe(beat(D, "d0", epoch=3))
    assert registry.epoch(D, "d0") == 3 and registry.stats.restarts == 1


def test_registry_is_bounded(clock: Clock) -> None:
    registry = WorkerRegistry(lease_s=3.0, max_workers=2, clock=clock)
    for name in ("a", "b", "c"):
        registry.observe(beat(D, name))
    assert registry.counts()["decode"] == 2 and registry.rejected == 1
    clock.now += 5
    registry.observe(beat(D, "c"))
    assert [s.heartbeat.worker_id for s in registry.alive(D)] == ["c"]


def test_modes_local_threshold_and_request_override(registry: WorkerRegistry) -> None:
    registry.observe(beat(P, "p0"))
    registry.observe(beat(D, "d0"))
    router = Router(registry, TransferMode.PUSH, local_threshold=256)
    assert router.route(255).mode is TransferMode.LOCAL
    push = router.route(256)
    assert (push.mode, push.prefill_id, push.decode_id) == (TransferMode.PUSH, "p0", "d0")
    assert router.route(10, TransferMode.PULL).mode is TransferMode.PULL
    assert router.route(1000, TransferMode.LOCAL).mode is TransferMode.LOCAL
    pull = Router(registry, TransferMode.PULL, local_threshold=0)
    assert pull.route(1).mode is TransferMode.PULL
    assert not push.prefill_sends_first_token  # an older P's heartbeat: D samples it
    registry.observe(beat(P, "p0", sends_first_token=True))
    assert router.route(256).prefill_sends_first_token
    assert not router.route(255).prefill_sends_first_token  # LOCAL: no P takes part
    with pytest.raises(ValueError):
        Router(registry, TransferMode.LOCAL, 0)


def test_local_without_prefill_is_decode_only_and_push_needs_prefill(
    registry: WorkerRegistry,
) -> None:
    registry.observe(beat(D, "d0"))
    router = Router(registry, TransferMode.PUSH, local_threshold=256)
    local = router.route(10)
    assert (local.prefill_id, local.decode_id, local.prefill_epoch) == (DECODE_ONLY, "d0", None)
    degraded = router.route(300)  # no prefill worker: decode computes it (degraded, not down)
    assert (degraded.mode, degraded.prefill_id) == (TransferMode.LOCAL, DECODE_ONLY)
    with pytest.raises(NoWorkerError) as info:
        router.route(300, TransferMode.PUSH)  # asked for a transfer: 503 with the reason
    assert info.value.role is P
    with pytest.raises(NoWorkerError):
        Router(WorkerRegistry(), TransferMode.PUSH, 256).route(10)


def test_local_requests_do_not_count_as_prefill_load(registry: WorkerRegistry) -> None:
    registry.observe(beat(P, "p0"))
    registry.observe(beat(D, "d0"))
    router = Router(registry, TransferMode.PUSH, local_threshold=256)
    for _ in range(3):
        assert router.route(10).prefill_epoch is None
    assert registry.pick(P, count=False).load == 0


def test_lost_names_the_role_whose_worker_died_or_restarted(
    registry: WorkerRegistry, clock: Clock
) -> None:
    registry.observe(beat(P, "p0"))
    registry.observe(beat(D, "d0"))
    router = Router(registry, TransferMode.PUSH, 0)
    route = router.route(10)
    assert router.lost(route) is None
    registry.observe(beat(P, "p0", epoch=2))
    assert router.lost(route) is P
    registry.observe(beat(D, "d0", epoch=2))
    assert router.lost(route) is D  # decode first: its work is lost
    route = router.route(10)
    assert router.lost(router.route(10, TransferMode.LOCAL)) is None
    clock.now += 3.5
    assert router.lost(route) is D


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_config_flags_beat_env_and_env_beats_defaults() -> None:
    env = {
        "KVPUSH_MODEL": "/models/env",
        "KVPUSH_API_KEYS": "a, b,",
        "KVPUSH_LOCAL_THRESHOLD": "64",
        "KVPUSH_MODE": "pull",
    }
    config = GatewayConfig.from_args(parse("--model", "/models/flag", "--port", "0"), env)
    assert config.model == "/models/flag" and config.port == 0
    assert config.api_keys == ("a", "b") and config.local_threshold == 64
    assert config.mode is TransferMode.PULL and config.max_inflight == 256
    keys = GatewayConfig.from_args(parse("--api-key", "x", "--api-key", "y"), env)
    assert keys.api_keys == ("x", "y")
    assert GatewayConfig.from_args(parse(), env).gateway_id.startswith("gw-")


def test_the_gateway_serves_on_an_inherited_socket_when_given_one() -> None:
    """--listen-fd: a listening socket its parent bound (kvpush up); none by default."""
    assert GatewayConfig.from_args(parse("--model", "m"), {}).listen_fd is None
    inherited = GatewayConfig.from_args(parse("--model", "m", "--listen-fd", "3"), {})
    assert inherited.listen_fd == 3
    with pytest.raises(ConfigError, match="--listen-fd must be >= 0"):
        GatewayConfig.from_args(parse("--model", "m", "--listen-fd", "-1"), {})


@pytest.mark.parametrize(
    "argv, env",
    [
        ((), {}),
        (("--model", "m", "--gateway-id", "bad.id"), {}),
        (("--model", "m", "--max-inflight", "0"), {}),
        (("--model", "m"), {"KVPUSH_LISTEN_FD": "-3"}),
        (("--model", "m"), {"KVPUSH_REQUEST_TIMEOUT_S": "soon"}),
        (("--model", "m"), {"KVPUSH_MODE": "local"}),
    ],
)
def test_bad_config_is_a_config_error(argv: tuple[str, ...], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        GatewayConfig.from_args(parse(*argv), env)


async def test_a_request_waits_a_few_leases_for_a_worker_that_missed_its_lease(
    registry: WorkerRegistry, clock: Clock
) -> None:
    """A worker that missed its lease on a busy host rejoins within a few: a request that
    needs its role waits for it (bounded) instead of a 503 at once; a role never seen: no wait."""
    assert not await registry.back(P, timeout_s=60.0)  # no prefill worker ever: at once
    registry.observe(beat(P, "p0"))
    clock.now += 3.1
    assert not registry.alive(P)
    waiting = asyncio.create_task(registry.back(P, timeout_s=60.0, poll_s=0.001))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    registry.observe(beat(P, "p0", epoch=2))  # it rejoined
    assert await waiting
    clock.now += 3.1
    assert not await registry.back(P, timeout_s=0.01, poll_s=0.001)  # bounded
