"""The NIXL transport between two real processes over random numpy pools (no mocks of NIXL).

The test process owns one ``KvTransport`` (seed 1); ``transport_peer.PeerProcess`` runs the other
(seed 2) in a spawned child that the fixtures kill on teardown.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpush.connector.layout import pair_runs, runs_to_ids
from kvpush.connector.poller import Poller
from kvpush.connector.sidechannel import IncompatiblePeerError
from kvpush.connector.transfer import Role, TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.schemas.messages import FailReason
from tests.integration.transport_peer import PeerProcess, PoolSpec, make_transport

pytestmark = pytest.mark.timeout(60)

LOCAL = PoolSpec(seed=1)
PEER = PoolSpec(seed=2)
TIMEOUT = 5.0
BLOCK_SETS = {  # name: (local runs, remote runs)
    "scattered": ([[0, 2], [5, 1], [9, 3]], [[3, 3], [9, 1], [12, 2]]),
    "contiguous": ([[0, 8]], [[0, 8]]),
    "offset": ([[4, 6]], [[9, 6]]),  # prefix hit: only the blocks after it move
}
_ids = iter(range(1, 1_000_000))


def new_tid() -> str:
    return f"tx-{next(_ids):08d}"


class Local:
    """The test process's transport plus an event collector keyed by transfer id."""

    def __init__(self, transport: KvTransport, pools: list[list[np.ndarray]]) -> None:
        self.t = transport
        self.pools = pools
        self.seen: dict[str, list[TransferEvent]] = {}

    def wait(self, tid: str, count: int = 1, timeout_s: float = TIMEOUT) -> list[TransferEvent]:
        deadline = time.monotonic() + timeout_s
        while len(self.seen.get(tid, [])) < count and time.monotonic() < deadline:
            for event in self.t.poll():
                self.seen.setdefault(event.transfer_id, []).append(event)
            time.sleep(0.0005)
        return self.seen.get(tid, [])


@pytest.fixture(scope="module")
def peer() -> Iterator[PeerProcess]:
    process = PeerProcess(PEER)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    transport, pools, _ = make_transport(LOCAL, "local", telemetry=True)
    try:
        yield Local(transport, pools)
    finally:
        transport.close()


def peer_blocks(peer: PeerProcess, layer: int, runs: list[list[int]]) -> list[np.ndarray]:
    ids = runs_to_ids(runs).tolist()
    return [peer.call("blocks", layer, r, ids) for r in range(PEER.regions)]


def local_blocks(local: Local, layer: int, runs: list[list[int]]) -> list[np.ndarray]:
    ids = runs_to_ids(runs)
    return [local.pools[layer][r][ids].copy() for r in range(LOCAL.regions)]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and np.array_equal(x, y)


def expected_descriptors(local_runs: list[list[int]], remote_runs: list[list[int]]) -> int:
    return len(pair_runs(local_runs, remote_runs)) * LOCAL.layers * LOCAL.regions


@pytest.mark.parametrize("streamed", [True, False], ids=["announced-early", "announced-late"])
@pytest.mark.parametrize("case", list(BLOCK_SETS))
def test_push_is_byte_exact_for_each_block_set_and_arrival_order(
    local: Local, peer: PeerProcess, case: str, streamed: bool
) -> None:
    local_runs, remote_runs = BLOCK_SETS[case]
    tid = new_tid()
    untouched = [[15, 1]]  # never a destination
    before = peer_blocks(peer, 0, untouched)
    peer.call("expect", tid, TIMEOUT)
    local.t.start_push(tid, peer.address, remote_runs, local_runs, TIMEOUT, peer.epoch)
    if streamed:  # announcement before prefill ends: one WRITE per computed layer
        for layer in range(LOCAL.layers):
            assert local.t.push_layers(tid, [layer])
    else:  # prefill done before the announcement: everything in one request on arrival
        assert local.t.push_layers(tid, range(LOCAL.layers))
    local.t.finish(tid)

    [event] = local.wait(tid)
    assert (event.state, event.quiesced, event.role) == (TransferState.DONE, True, Role.PUSH)
    blocks = len(runs_to_ids(local_runs))
    assert event.bytes == blocks * LOCAL.layers * LOCAL.regions * LOCAL.block_bytes
    assert event.descriptors == expected_descriptors(local_runs, remote_runs)
    assert event.nixl_descriptors == event.descriptors  # NIXL merged prepped rows to our count
    assert [t.layer for t in event.layers] == list(range(LOCAL.layers))
    [target] = peer.wait_events(tid)
    assert (target.transfer_id, target.state, target.quiesced) == (tid, TransferState.DONE, True)
    for layer in range(LOCAL.layers):
        assert_same(peer_blocks(peer, layer, remote_runs), local_blocks(local, layer, local_runs))
    assert_same(peer_blocks(peer, 0, untouched), before)
    assert local.t.live_handles == 0


def test_push_of_coalesced_rows_without_prepped_lists_is_byte_exact(peer: PeerProcess) -> None:
    transport, pools, _ = make_transport(LOCAL, "rows", prep_limit=0)  # pool "too big to prep"
    local = Local(transport, pools)
    try:
        local_runs, remote_runs = BLOCK_SETS["scattered"]
        tid = new_tid()
        peer.call("expect", tid, TIMEOUT)
        transport.start_push(tid, peer.address, remote_runs, local_runs, TIMEOUT, peer.epoch)
        for layer in range(LOCAL.layers):
            transport.push_layers(tid, [layer])
        transport.finish(tid)
        [event] = local.wait(tid)
        assert event.state is TransferState.DONE
        assert event.descriptors == expected_descriptors(local_runs, remote_runs)
        assert peer.wait_events(tid)[0].state is TransferState.DONE
        for layer in range(LOCAL.layers):
            assert_same(
                peer_blocks(peer, layer, remote_runs), local_blocks(local, layer, local_runs)
            )
    finally:
        transport.close()


@pytest.mark.parametrize("case", list(BLOCK_SETS))
def test_pull_is_byte_exact_and_tells_the_owner_its_blocks_are_free(
    local: Local, peer: PeerProcess, case: str
) -> None:
    remote_runs, local_runs = BLOCK_SETS[case]  # read the peer's "local" side into ours
    tid = new_tid()
    peer.call("expect", tid, TIMEOUT)
    local.t.start_pull(tid, peer.address, remote_runs, local_runs, TIMEOUT, peer.epoch)
    [event] = local.wait(tid)
    assert (event.state, event.quiesced, event.role) == (TransferState.DONE, True, Role.PULL)
    [owner] = peer.wait_events(tid)
    assert (owner.transfer_id, owner.state) == (tid, TransferState.DONE)
    for layer in range(LOCAL.layers):
        assert_same(local_blocks(local, layer, local_runs), peer_blocks(peer, layer, remote_runs))


def test_completion_notice_that_beats_expect_still_completes_the_target(
    local: Local, peer: PeerProcess
) -> None:
    tid = new_tid()
    local.t.start_push(tid, peer.address, [[0, 2]], [[1, 2]], TIMEOUT, peer.epoch)
    local.t.push_layers(tid, range(LOCAL.layers))
    local.t.finish(tid)
    assert local.wait(tid)[0].state is TransferState.DONE
    time.sleep(0.05)  # the peer has polled the notice before it expects the transfer
    peer.call("expect", tid, TIMEOUT)
    [target] = peer.wait_events(tid)
    assert (target.transfer_id, target.state) == (tid, TransferState.DONE)


def test_poller_thread_reports_a_pushed_transfer_without_the_owner_polling(
    local: Local, peer: PeerProcess
) -> None:
    tid = new_tid()
    local.t.expect(tid, TIMEOUT, peer.address)
    poller = Poller(local.t, busy_interval_s=0.0005, idle_interval_s=0.005)
    try:
        peer.call("push", tid, local.t.address, [[6, 2]], [[0, 2]], [[0], [1, 2]], TIMEOUT, None)
        event = poller.events.get(timeout=TIMEOUT)
        assert (event.transfer_id, event.state, event.role) == (
            tid,
            TransferState.DONE,
            Role.TARGET,
        )
        [pushed] = peer.wait_events(tid)
        assert (pushed.state, pushed.role) == (TransferState.DONE, Role.PUSH)
    finally:
        poller.stop()
    assert_same(local_blocks(local, 2, [[6, 2]]), peer_blocks(peer, 2, [[0, 2]]))


def test_abort_while_posted_is_acknowledged_and_nothing_more_is_written(
    local: Local, peer: PeerProcess
) -> None:
    tid = new_tid()
    remote_runs, local_runs = [[4, 3]], [[0, 3]]
    later_layers = [peer_blocks(peer, layer, remote_runs) for layer in (1, 2)]
    peer.call("expect", tid, TIMEOUT)
    local.t.start_push(tid, peer.address, remote_runs, local_runs, TIMEOUT, peer.epoch)
    assert local.t.push_layers(tid, [0])
    assert local.t.state(tid) is TransferState.POSTED
    local.t.abort(tid, "client went away")
    assert local.t.push_layers(tid, [1]) is False  # an aborted transfer never posts again

    [ack] = local.wait(tid)
    assert (ack.state, ack.quiesced, ack.reason) == (
        TransferState.ABORTED,
        True,
        FailReason.ABORTED,
    )
    assert local.t.live_handles == 0
    [target] = peer.wait_events(tid)
    assert (target.state, target.quiesced) == (TransferState.ABORTED, True)
    assert_same(peer_blocks(peer, 0, remote_runs), local_blocks(local, 0, local_runs))
    for layer, before in zip((1, 2), later_layers, strict=True):
        assert_same(peer_blocks(peer, layer, remote_runs), before)


def test_target_abort_waits_for_the_initiators_word_before_freeing(
    local: Local, peer: PeerProcess
) -> None:
    tid = new_tid()
    local.t.expect(tid, TIMEOUT, peer.address)
    local.t.abort(tid, "gateway abort")
    assert local.t.state(tid) is TransferState.ABORTING
    assert local.wait(tid, timeout_s=0.1) == []  # no ack yet: blocks stay reserved
    peer.call("push", tid, local.t.address, [[0, 1]], [[0, 1]], [[0]], TIMEOUT, None)
    [event] = local.wait(tid)
    assert (event.state, event.quiesced) == (TransferState.ABORTED, True)


def test_target_abort_is_released_by_the_initiators_ack_over_the_bus(local: Local) -> None:
    tid = new_tid()
    local.t.expect(tid, TIMEOUT)
    local.t.abort(tid)
    assert local.wait(tid, timeout_s=0.05) == []
    local.t.acknowledged(tid)  # AbortAck arrived on the bus
    [event] = local.wait(tid)
    assert (event.state, event.quiesced) == (TransferState.ABORTED, True)


@pytest.mark.parametrize("error_mode", ["none", "peer"])
def test_killed_peer_fails_the_push_within_its_deadline_and_leaks_no_handle(
    error_mode: str,
) -> None:
    params = {"backend_params": {"ucx_error_handling_mode": error_mode}}
    victim = PeerProcess(PoolSpec(seed=2, extra=params), name="victim")
    transport, pools, _ = make_transport(LOCAL, "survivor", handshake_timeout_s=1.0, **params)
    local = Local(transport, pools)
    try:
        push, recv = new_tid(), new_tid()
        transport.connect(victim.address, victim.epoch)
        victim.call("expect", push, TIMEOUT)
        transport.expect(recv, 1.0, victim.address)  # the victim was to push this one to us
        transport.start_push(push, victim.address, [[0, 4]], [[0, 4]], TIMEOUT, victim.epoch)
        assert transport.push_layers(push, [0])
        victim.kill()
        started = time.monotonic()
        transport.push_layers(push, [1])
        transport.push_layers(push, [2])
        transport.finish(push)
        [event] = local.wait(push)
        assert event.state is TransferState.FAILED
        assert event.reason in (FailReason.POST, FailReason.TRANSFER)
        assert "DISCONNECT" in event.detail or "notice" in event.detail
        assert event.quiesced and time.monotonic() - started < TIMEOUT
        assert transport.live_handles == 0
        assert transport.state(push) is TransferState.FAILED  # reaped, still answerable
        assert transport.push_layers(push, [2]) is False

        [expired] = local.wait(recv, timeout_s=3.0)  # D never waits forever
        assert (expired.state, expired.quiesced) == (TransferState.EXPIRED, False)
        transport.peer_lost(victim.address)  # lease lost: now its blocks may be reused
        [released] = local.wait(recv, count=2)[1:]
        assert (released.state, released.quiesced) == (TransferState.EXPIRED, True)

        again = new_tid()
        transport.start_push(again, victim.address, [[0, 1]], [[0, 1]], TIMEOUT, None)
        [event] = local.wait(again, timeout_s=3.0)
        assert (event.state, event.reason) == (TransferState.FAILED, FailReason.HANDSHAKE)
        assert transport.active() == 0 and transport.live_handles == 0
    finally:
        victim.close()
        transport.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (PoolSpec(seed=3, dtype="float16"), "dtype: local 'float32', peer 'float16'"),
        (PoolSpec(seed=3, block_bytes=6144), "bytes per block"),  # no TP maps 8192 to it
    ],
    ids=["dtype", "geometry"],
)
def test_incompatible_peer_is_refused_with_a_clear_error(
    local: Local, spec: PoolSpec, message: str
) -> None:
    other = PeerProcess(spec, name="other")
    try:
        with pytest.raises(IncompatiblePeerError, match=message):
            local.t.connect(other.address)
        tid = new_tid()
        local.t.start_push(tid, other.address, [[0, 1]], [[0, 1]], TIMEOUT, None)
        [event] = local.wait(tid)
        assert (event.state, event.reason) == (TransferState.FAILED, FailReason.INCOMPATIBLE)
        assert message in event.detail
    finally:
        other.close()


def test_a_pool_of_half_blocks_connects_but_a_whole_block_transfer_is_refused(
    local: Local,
) -> None:
    """Half the bytes per block is what a peer of twice the TP has: the handshake accepts it,
    and a transfer whose slices do not match (whole blocks both sides) fails before any
    request is posted."""
    other = PeerProcess(PoolSpec(seed=3, block_bytes=4096), name="half")
    try:
        local.t.connect(other.address)
        tid = new_tid()
        local.t.start_push(tid, other.address, [[0, 1]], [[0, 1]], TIMEOUT, None)
        [event] = local.wait(tid)
        assert (event.state, event.reason) == (TransferState.FAILED, FailReason.INCOMPATIBLE)
        assert "do not match" in event.detail and event.bytes == 0
        assert local.t.live_handles == 0
    finally:
        other.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_peer_restart_with_a_new_epoch_replaces_the_cached_metadata(local: Local) -> None:
    spec = PoolSpec(seed=4, extra={"port": _free_port()})
    first = PeerProcess(spec, name="phoenix")
    try:
        assert local.t.connect(first.address, first.epoch).epoch == first.epoch
    finally:
        first.close()
    time.sleep(0.01)  # the epoch is wall-clock milliseconds: make it differ
    second = PeerProcess(spec, name="phoenix")
    try:
        assert second.address == first.address and second.epoch != first.epoch
        tid = new_tid()
        second.call("expect", tid, TIMEOUT)
        local.t.start_push(tid, second.address, [[2, 2]], [[0, 2]], TIMEOUT, second.epoch)
        local.t.push_layers(tid, range(LOCAL.layers))
        local.t.finish(tid)
        [event] = local.wait(tid)
        assert event.state is TransferState.DONE
        assert second.wait_events(tid)[0].state is TransferState.DONE
        assert_same(peer_blocks(second, 1, [[2, 2]]), local_blocks(local, 1, [[0, 2]]))

        stale = new_tid()  # an announcement from the dead incarnation fails; the live peer stays
        local.t.start_push(stale, second.address, [[2, 2]], [[0, 2]], TIMEOUT, first.epoch)
        [event] = local.wait(stale)
        assert (event.state, event.reason) == (TransferState.FAILED, FailReason.HANDSHAKE)
        assert "epoch" in event.detail
        assert local.t.connect(second.address).epoch == second.epoch
    finally:
        second.close()
