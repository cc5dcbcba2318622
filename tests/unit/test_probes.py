"""The decode side's probe of a silent prefill peer: a port that refuses is a dead P (its
transfers fail now); a port that accepts but does not answer is a stopped or hung P, whose
blocks D keeps (it may still write into them once it resumes) until ``peer_silent_dead_s``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvpush.connector.params import ConnectorSettings
from kvpush.connector.peering import CompatInfo
from kvpush.connector.vllm.probes import PeerState, ProbingMixin, port_refuses
from kvpush.schemas.messages import WorkerRole


@pytest.fixture
def silent_port() -> Iterator[str]:
    """A port whose listener never answers (the kernel accepts; no one reads): a stopped P."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_port() -> str:
    """A port nothing listens on any more: a dead P."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def test_only_a_refusing_port_is_proof_of_death(silent_port: str, closed_port: str) -> None:
    assert port_refuses(closed_port)
    assert not port_refuses(silent_port)
    assert not port_refuses("ipc:///tmp/kvpush-no-such-socket")  # no proof either way


@dataclass
class _Runtime:
    wakes: list[float] = field(default_factory=list)

    def wake_at(self, when: float) -> None:
        self.wakes.append(when)

    def notify(self) -> None:
        pass


@dataclass
class _Transport:
    config: object
    lost: list[str] = field(default_factory=list)

    def peer_lost(self, address: str) -> None:
        self.lost.append(address)


class _Side(ProbingMixin):
    def __init__(self) -> None:
        self.settings = ConnectorSettings(
            worker_id="d", role=WorkerRole.DECODE, peer_silent_dead_s=30.0
        )
        compat = CompatInfo(model="m", dtype="float32", block_size=16, layout="nhd")
        self.transport = _Transport(SimpleNamespace(compat=compat, token=None))  # type: ignore[assignment]
        self.runtime = _Runtime()  # type: ignore[assignment]
        self.lock = threading.RLock()
        self._by_tid = {}
        self._probing = set()

    def _settle(self, inc: object, state: object) -> None:
        raise AssertionError("no receive is waiting in these tests")


def _aborting() -> SimpleNamespace:
    return SimpleNamespace(probing=True, silent_since=None, abort_sent_at=0.0)


def test_probe_states(silent_port: str, closed_port: str) -> None:
    side = _Side()
    assert side._peer_state(closed_port) is PeerState.DEAD
    assert side._peer_state(silent_port) is PeerState.SILENT


def test_a_silent_peer_keeps_its_blocks_and_is_probed_again(silent_port: str) -> None:
    side = _Side()
    side._probe([silent_port])  # a suspect (its lease ended): nothing fails
    inc = _aborting()
    side._probe([silent_port], inc)  # type: ignore[arg-type]
    assert side.transport.lost == []
    assert inc.silent_since is not None and not inc.probing
    assert inc.abort_sent_at > 0.0 and side.runtime.wakes  # its ack is waited for again


def test_a_peer_silent_past_its_bound_is_presumed_dead(silent_port: str) -> None:
    side = _Side()
    inc = _aborting()
    inc.silent_since = time.monotonic() - 31.0  # silent since more than peer_silent_dead_s
    side._probe([silent_port], inc)  # type: ignore[arg-type]
    assert side.transport.lost == [silent_port]


def test_a_dead_peer_fails_at_once(closed_port: str) -> None:
    side = _Side()
    side._probe([closed_port])
    assert side.transport.lost == [closed_port]
