"""The side channel: each agent serves its NIXL metadata and pool layout over pyzmq.

Owns the wire structs (msgpack via msgspec; no pickle anywhere), the server, the one-shot
client fetch with its compatibility check, and the per-peer cache.

Protocol (one request, one reply, ROUTER <-> REQ):
  ``Hello(compat, agent_name)`` -> ``PeerInfo(compat, compat_hash, epoch, agent_name,
  agent_metadata, pool)`` or ``Refused(code, detail, compat)``.
The server refuses a peer whose compat hash differs (and says why); the client checks again on
its side, so both ends log a clear error. With a shared token (``KVPUSH_SIDE_CHANNEL_TOKEN`` on
every worker) the server also refuses a Hello without a valid proof: HMAC-SHA256 over a fresh
nonce, the send time and the peer's compat hash (the token itself never crosses the wire; a
replayed Hello is refused: nonces are remembered, and the send time must be within
``MAX_SKEW_MS``). The agent metadata is what lets a peer WRITE into registered memory, so only
peers that know the token get it. ``agent_metadata`` is NIXL's own serialised agent
metadata (an opaque byte string); ``pool`` is plain integers; descriptors are built locally.

Threading model:
- ``SideChannelServer`` runs one daemon thread that owns its zmq socket; it polls with a 100 ms
  timeout to notice ``stop()``. It only ever sends its one pre-encoded reply, so it never
  touches NIXL.
- ``fetch_peer`` is blocking and bounded by ``timeout_s``; it opens a fresh REQ socket per call
  (no stuck REQ state after a timeout) with LINGER 0.
- ``HandshakeFetches`` runs fetches on a small thread pool (``request`` returns a Future); its
  table of fetches in flight is only read and written by its owner thread (the transport, under
  its lock). Peers once fetched are the transfer engine's (``PeerLink``), not kept here.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import zmq

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.layout import PoolLayout
from kvpush.connector.peering import CompatInfo, compat_diff, compat_hash

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024
MAX_SKEW_MS = 120_000  # a Hello's send time may differ this much from the server's clock
NONCE_MEMORY = 8192


def hello_mac(token: str, nonce: bytes, sent_ms: int, agent_name: str, compat: CompatInfo) -> bytes:
    message = b"kvpush-sc-v1|%s|%d|%s|%s" % (
        nonce,
        sent_ms,
        agent_name.encode(),
        compat_hash(compat).encode(),
    )
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def make_hello(compat: CompatInfo, agent_name: str, token: str | None) -> Hello:
    if not token:
        return Hello(compat=compat, agent_name=agent_name)
    nonce, sent_ms = secrets.token_bytes(16), int(time.time() * 1000)
    mac = hello_mac(token, nonce, sent_ms, agent_name, compat)
    return Hello(compat=compat, agent_name=agent_name, nonce=nonce, sent_ms=sent_ms, mac=mac)


class Hello(msgspec.Struct, frozen=True, tag="kvpush.sc.Hello"):
    compat: CompatInfo
    agent_name: str
    nonce: bytes = b""  # with a shared token: 16 random bytes, sent_ms and their HMAC
    sent_ms: int = 0
    mac: bytes = b""


class PeerInfo(msgspec.Struct, frozen=True, tag="kvpush.sc.PeerInfo"):
    compat: CompatInfo
    compat_hash: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    pool: PoolLayout


class Refused(msgspec.Struct, frozen=True, tag="kvpush.sc.Refused"):
    code: str  # "incompatible" | "bad_request" | "unauthorized"
    detail: str
    compat: CompatInfo | None = None


Reply = PeerInfo | Refused
_request_decoder = msgspec.msgpack.Decoder(Hello)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


class TransportError(RuntimeError):
    """Base of the transport's errors."""


class HandshakeError(TransportError):
    """The peer's side channel did not answer in time or answered garbage."""


class IncompatiblePeerError(TransportError):
    """The peer runs a different protocol/model/dtype/block size/layout/tp or pool geometry."""

    def __init__(self, address: str, differences: list[str]) -> None:
        self.address = address
        self.differences = differences
        super().__init__(
            f"peer {address} is incompatible with this engine: " + "; ".join(differences)
        )


class SideChannelServer:
    """Serves this agent's ``PeerInfo`` on ``tcp://host:port`` (port 0: an ephemeral port)."""

    def __init__(
        self, info: PeerInfo, host: str = "127.0.0.1", port: int = 0, token: str | None = None
    ) -> None:
        self._info = info
        self._token = token or None
        self._nonces: BoundedDict[bytes, None] = BoundedDict(NONCE_MEMORY)
        self._reply = _encoder.encode(info)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 256)  # overflow: zmq drops; clients time out
        self._sock.setsockopt(zmq.SNDHWM, 256)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpush-sidechannel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                continue
            ident, payload = frames[0], frames[-1]
            self._sock.send_multipart([ident, b"", self._answer(payload)])
        self._sock.close(0)
        self._ctx.term()

    def _answer(self, payload: bytes) -> bytes:
        try:
            hello = _request_decoder.decode(payload)
        except msgspec.DecodeError as exc:  # ValidationError is one
            return _encoder.encode(Refused(code="bad_request", detail=str(exc)[:500]))
        if self._token is not None and not self._authentic(hello):
            log.warning("refusing peer %s: no valid token proof", hello.agent_name[:100])
            return _encoder.encode(Refused(code="unauthorized", detail="no valid token proof"))
        mine = self._info.compat
        if compat_hash(hello.compat) != self._info.compat_hash:
            diff = compat_diff(mine, hello.compat)
            log.warning("refusing incompatible peer %s: %s", hello.agent_name, "; ".join(diff))
            return _encoder.encode(
                Refused(code="incompatible", detail="; ".join(diff), compat=mine)
            )
        return self._reply

    def _authentic(self, hello: Hello) -> bool:
        assert self._token is not None
        if len(hello.nonce) != 16 or abs(time.time() * 1000 - hello.sent_ms) > MAX_SKEW_MS:
            return False
        want = hello_mac(self._token, hello.nonce, hello.sent_ms, hello.agent_name, hello.compat)
        if not hmac.compare_digest(want, hello.mac) or hello.nonce in self._nonces:
            return False
        self._nonces[hello.nonce] = None
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def fetch_peer(
    address: str,
    compat: CompatInfo,
    agent_name: str,
    timeout_s: float,
    token: str | None = None,
) -> PeerInfo:
    """Ask ``address`` for its ``PeerInfo``; raise ``HandshakeError``/``IncompatiblePeerError``."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(address)
        sock.send(_encoder.encode(make_hello(compat, agent_name, token)))
        payload = sock.recv()
    except zmq.Again as exc:
        raise HandshakeError(f"peer {address} did not answer within {timeout_s:.1f}s") from exc
    except zmq.ZMQError as exc:
        raise HandshakeError(f"side channel to {address} failed: {exc}") from exc
    finally:
        sock.close(0)
    try:
        reply = _reply_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HandshakeError(f"peer {address} sent an unreadable reply: {exc}") from exc
    if isinstance(reply, Refused):
        if reply.code == "incompatible" and reply.compat is not None:
            raise IncompatiblePeerError(address, compat_diff(compat, reply.compat))
        raise HandshakeError(f"peer {address} refused the handshake: {reply.detail}")
    if reply.compat_hash != compat_hash(compat) or compat_hash(reply.compat) != reply.compat_hash:
        raise IncompatiblePeerError(address, compat_diff(compat, reply.compat) or ["compat hash"])
    return reply


class HandshakeFetches:
    """The side-channel fetches in flight, by peer address; they run off the owner thread.

    ``request`` starts (or joins) a fetch and returns its Future; ``settle`` takes a finished
    one's outcome. Bound: one in-flight fetch per address, two fetches at a time.
    """

    def __init__(
        self, compat: CompatInfo, agent_name: str, timeout_s: float, token: str | None = None
    ) -> None:
        self._fetch = functools.partial(
            fetch_peer, compat=compat, agent_name=agent_name, timeout_s=timeout_s, token=token
        )
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpush-hs")
        self._pending: dict[str, Future[PeerInfo]] = {}

    def request(self, address: str) -> Future[PeerInfo]:
        if address not in self._pending:
            self._pending[address] = self._pool.submit(self._fetch, address)
        return self._pending[address]

    def settle(self, address: str) -> PeerInfo | BaseException | None:
        """The outcome of a finished fetch, or None while it is still running."""
        future = self._pending.get(address)
        if future is None or not future.done():
            return None
        del self._pending[address]
        return future.exception() or future.result()

    def pending(self) -> list[str]:
        return list(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
