"""Side-channel security: the shared token, replay, binding to the configured interface, and no
pickle on any kvpush wire.

The side channel is plain pyzmq + msgpack (no NIXL needed here): a ``SideChannelServer`` serves a
``PeerInfo`` whose ``agent_metadata`` is what lets a peer WRITE into registered memory, so it must
go only to peers that prove they know the token.
"""

from __future__ import annotations

import ast
import pickle
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpush.connector.layout import PoolLayout
from kvpush.connector.peering import CompatInfo, compat_hash
from kvpush.connector.sidechannel import (
    HandshakeError,
    Hello,
    IncompatiblePeerError,
    PeerInfo,
    Refused,
    SideChannelServer,
    fetch_peer,
    make_hello,
)
from kvpush.schemas import codec
from kvpush.schemas.codec import MessageError

COMPAT = CompatInfo(model="m", dtype="float32", block_size=128, layout="vllm-paged-LBHNC")
TOKEN = "s3cret-token"
ROOT = Path(__file__).resolve().parents[2]


def info() -> PeerInfo:
    pool = msgspec.convert({"mem_type": "DRAM", "layers": []}, PoolLayout)
    return PeerInfo(
        compat=COMPAT,
        compat_hash=compat_hash(COMPAT),
        epoch=7,
        agent_name="p0",
        agent_metadata=b"\x00nixl-metadata",
        pool=pool,
    )


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    srv = SideChannelServer(info(), "127.0.0.1", 0, token=TOKEN)
    yield srv
    srv.stop()


def address(srv: SideChannelServer) -> str:
    return f"tcp://127.0.0.1:{srv.port}"


def raw_request(srv: SideChannelServer, payload: bytes) -> PeerInfo | Refused:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        sock.connect(address(srv))
        sock.send(payload)
        return msgspec.msgpack.decode(sock.recv(), type=PeerInfo | Refused)
    finally:
        sock.close(0)


def test_a_peer_with_the_token_gets_the_metadata(server: SideChannelServer) -> None:
    got = fetch_peer(address(server), COMPAT, "d0", 3.0, token=TOKEN)
    assert got.agent_metadata == b"\x00nixl-metadata" and got.epoch == 7


@pytest.mark.parametrize("token", [None, "", "wrong-token"])
def test_a_peer_without_the_token_is_refused(server: SideChannelServer, token: str | None) -> None:
    with pytest.raises(HandshakeError, match="no valid token proof"):
        fetch_peer(address(server), COMPAT, "intruder", 3.0, token=token)


def test_a_replayed_or_stale_hello_is_refused(server: SideChannelServer) -> None:
    hello = make_hello(COMPAT, "d0", TOKEN)
    payload = msgspec.msgpack.encode(hello)
    assert isinstance(raw_request(server, payload), PeerInfo)
    replay = raw_request(server, payload)  # the same bytes, seen on the wire
    assert isinstance(replay, Refused) and replay.code == "unauthorized"
    stale = make_hello(COMPAT, "d0", TOKEN)
    old = Hello(
        compat=COMPAT, agent_name="d0", nonce=stale.nonce, sent_ms=stale.sent_ms - 600_000,
        mac=stale.mac,
    )  # fmt: skip
    refused = raw_request(server, msgspec.msgpack.encode(old))
    assert isinstance(refused, Refused) and refused.code == "unauthorized"
    forged = Hello(
        compat=COMPAT, agent_name="evil", nonce=stale.nonce, sent_ms=stale.sent_ms, mac=stale.mac
    )  # fmt: skip  (a proof made for another agent name)
    refused = raw_request(server, msgspec.msgpack.encode(forged))
    assert isinstance(refused, Refused) and refused.code == "unauthorized"
    assert isinstance(raw_request(server, msgspec.msgpack.encode(stale)), PeerInfo)


def test_garbage_and_pickles_are_refused_not_unpickled(server: SideChannelServer) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("unpickled!",))

    for payload in (b"\x00\x01garbage", pickle.dumps(Boom())):
        refused = raw_request(server, payload)
        assert isinstance(refused, Refused) and refused.code == "bad_request"
    assert isinstance(fetch_peer(address(server), COMPAT, "d0", 3.0, token=TOKEN), PeerInfo)


def test_an_incompatible_peer_is_refused_even_with_the_token(server: SideChannelServer) -> None:
    other = CompatInfo(model="m", dtype="bfloat16", block_size=128, layout="vllm-paged-LBHNC")
    with pytest.raises(IncompatiblePeerError, match="dtype"):
        fetch_peer(address(server), other, "d0", 3.0, token=TOKEN)


def test_without_a_token_configured_any_compatible_peer_is_served() -> None:
    srv = SideChannelServer(info(), "127.0.0.1", 0)
    try:
        assert fetch_peer(address(srv), COMPAT, "d0", 3.0).epoch == 7
        assert fetch_peer(address(srv), COMPAT, "d0", 3.0, token="any").epoch == 7
    finally:
        srv.stop()


def listening_addresses(port: int) -> set[str]:
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host_hex, port_hex = local.split(":")
        if int(port_hex, 16) == port and state == "0A":  # LISTEN
            octets = [str(int(host_hex[i : i + 2], 16)) for i in (6, 4, 2, 0)]
            found.add(".".join(octets))
    return found


def test_the_side_channel_binds_only_the_configured_interface() -> None:
    srv = SideChannelServer(info(), "127.0.0.2", 0)
    try:
        assert listening_addresses(srv.port) == {"127.0.0.2"}
        assert fetch_peer(f"tcp://127.0.0.2:{srv.port}", COMPAT, "d0", 3.0).epoch == 7
        with pytest.raises(HandshakeError, match="did not answer"):
            fetch_peer(f"tcp://127.0.0.1:{srv.port}", COMPAT, "d0", 0.5)
    finally:
        srv.stop()


def test_no_kvpush_wire_uses_pickle() -> None:
    """Bus messages are JSON (msgspec), the side channel msgpack; no module of ours imports
    pickle (vLLM pickles its own scheduler->worker metadata between its processes; that is
    vLLM's IPC, not a kvpush wire)."""
    for folder in ("services", "connector", "schemas"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                assert not any(
                    n.split(".")[0] in {"pickle", "cloudpickle", "dill"} for n in names
                ), f"{path}: imports {names}"
    with pytest.raises(MessageError):
        codec.decode("kvpush.v1.req.p0.d0", pickle.dumps({"type": "kvpush.v1.RequestEvent"}))
