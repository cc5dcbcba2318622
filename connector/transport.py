"""``KvTransport``: the vLLM-free transport facade, one per engine process (both roles).

Ties together the NIXL agent (agent.py), the pool layout (layout.py), the side channel
(sidechannel.py), the transfer state machine (transfer.py) and its engine (engine.py), built as
``TransportConfig`` (transport_config.py) says. What a connector calls:

- decode side (push target): ``expect(tid, timeout_s)`` before announcing its blocks (with
  ``address``, ``epoch`` and ``compat_hash`` in the announcement), then ``poll()`` until the
  transfer's event: DONE means the KV is in place; anything else means fall back.
- prefill side (push initiator): ``start_push(tid, peer, remote_runs, local_runs, timeout_s,
  peer_epoch)`` when the announcement arrives; ``push_layers(tid, [i])`` after layer ``i`` is
  computed (or all layers in one call when the announcement came late); ``finish(tid)``.
  ``poll()`` reports DONE once every WRITE is done and the notice was sent. Free source blocks
  only on an event with ``quiesced=True``.
- pull: ``start_pull`` on the reader (one READ per layer group, finishes by itself) and
  ``expect`` on the owner of the blocks (its DONE event says the blocks may be freed).
- ``abort(tid)`` (the ABORTED event is the acknowledgement), ``fail(tid, reason)``,
  ``peer_lost(address)`` once a peer's heartbeat lease expired.

Threading model: every public method takes one re-entrant lock, so the owner thread (the
engine's worker) and a ``Poller`` thread may both call in; NIXL is entered only under that lock.
``poll()`` drives NIXL progress (request status, notifications): there is no NIXL progress
thread. Handshakes run on the peer cache's fetch threads; ``poll()`` (or the blocking
``connect``) installs their result into NIXL. The side-channel server thread never touches NIXL.
``Poller`` (poller.py) calls ``poll()`` as often as ``poll_interval`` says; every post, expect,
abort and acknowledgement wakes it through ``on_change``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvpush.connector.agent import AgentConfig, AgentError, NixlAgent
from kvpush.connector.engine import TransferEngine
from kvpush.connector.layout import PoolLayout, Runs
from kvpush.connector.layout import per_block_descs as _per_block_descs
from kvpush.connector.peering import compat_hash, geometry_diff
from kvpush.connector.sidechannel import (
    HandshakeError,
    HandshakeFetches,
    IncompatiblePeerError,
    PeerInfo,
    SideChannelServer,
    TransportError,
)
from kvpush.connector.transfer import (
    LateChecksum,
    LegSpec,
    PeerLink,
    Role,
    TransferEvent,
    TransferState,
)
from kvpush.connector.transport_config import TransportConfig
from kvpush.schemas.messages import FailReason

log = logging.getLogger(__name__)


class KvTransport:
    def __init__(self, config: TransportConfig, layout: PoolLayout) -> None:
        self.config = config
        self.layout = layout
        self.epoch = config.epoch or time.time_ns() // 1_000_000
        self.compat_hash = compat_hash(config.compat)
        self.agent_name = f"{config.worker_id}-{self.epoch}"
        advertised = config.advertise_host or config.host
        if advertised in ("0.0.0.0", "*"):
            raise ValueError("bound to all interfaces: give an advertise host peers can reach")
        self._lock = threading.RLock()
        self._closed = False
        self._agent = NixlAgent(
            AgentConfig(
                name=self.agent_name,
                backend=config.backend,
                backend_params=config.backend_params,
                ucx_env=config.ucx_env,
                telemetry=config.telemetry,
            )
        )
        try:
            self._agent.register(layout)
            local_prep = (
                self._agent.prep(None, _per_block_descs(layout), layout.mem_type)
                if layout.prepped_size() <= config.prep_limit
                else None
            )
            self._engine = TransferEngine(
                self._agent,
                layout,
                local_prep,
                cancel_grace_s=config.cancel_grace_s,
                max_transfers=config.max_transfers,
                max_early_notices=config.max_early_notices,
                clock=time.monotonic,
            )
            self._server = SideChannelServer(
                PeerInfo(
                    compat=config.compat,
                    compat_hash=self.compat_hash,
                    epoch=self.epoch,
                    agent_name=self.agent_name,
                    agent_metadata=self._agent.metadata(),
                    pool=layout,
                ),
                config.host,
                config.port,
                config.token,
            )
        except Exception:
            self._agent.close()
            raise
        self.address = f"tcp://{advertised}:{self._server.port}"
        self._peers = HandshakeFetches(
            config.compat, self.agent_name, config.handshake_timeout_s, token=config.token
        )
        self.on_change: Callable[[], None] | None = None  # set by a Poller: wake it up

    # ---- peers ------------------------------------------------------------------------------
    def connect(
        self, address: str, epoch: int | None = None, timeout_s: float | None = None
    ) -> PeerInfo:
        """Blocking handshake (warms the cache). Raises Handshake/IncompatiblePeerError."""
        with self._lock:
            link = self._link(address, epoch)
            if link is not None:
                return link.info
            future = self._peers.request(address)
        with contextlib.suppress(Exception):  # the outcome is raised by _settle below
            future.result(timeout=timeout_s or self.config.handshake_timeout_s + 1.0)
        with self._lock:
            outcome = self._settle(address)
            if isinstance(outcome, BaseException):
                raise outcome
            link = self._engine.peers.get(address)
            if link is None:
                raise TransportError(f"peer {address} could not be installed")
            if epoch is not None and link.info.epoch != epoch:
                raise HandshakeError(
                    f"peer {address} is at epoch {link.info.epoch}, expected {epoch}"
                )
            return link.info

    def _link(self, address: str, epoch: int | None) -> PeerLink | None:
        """The attached peer; a *newer* epoch than cached means it restarted: drop the old one.
        (An older epoch is a stale announcement: the transfer fails against the current one.)"""
        link = self._engine.peers.get(address)
        if link is not None and epoch is not None and epoch > link.info.epoch:
            log.info(
                "peer %s moved to epoch %d (was %d): dropping the old agent",
                address,
                epoch,
                link.info.epoch,
            )
            self._drop(address, "the peer restarted (epoch changed)")
            return None
        return link

    def _settle(self, address: str) -> PeerInfo | BaseException | None:
        """Install a finished handshake into NIXL, or fail the transfers that waited on it."""
        outcome = self._peers.settle(address)
        if isinstance(outcome, PeerInfo) and (diff := geometry_diff(self.layout, outcome.pool)):
            outcome = IncompatiblePeerError(address, diff)
        if isinstance(outcome, BaseException):
            log.warning("handshake with %s failed: %s", address, outcome)
            incompatible = isinstance(outcome, IncompatiblePeerError)
            reason = FailReason.INCOMPATIBLE if incompatible else FailReason.HANDSHAKE
            self._engine.fail_waiting(address, reason, str(outcome))
            return outcome
        if outcome is None:
            return None
        pool = outcome.pool
        try:
            name = self._agent.add_peer(outcome.agent_metadata)
            prep = None
            if (
                self._engine.local_prep is not None
                and pool.prepped_size() <= self.config.prep_limit
            ):
                prep = self._agent.prep(name, _per_block_descs(pool), pool.mem_type)
        except AgentError as exc:
            self._engine.fail_waiting(address, FailReason.HANDSHAKE, str(exc))
            return exc
        self._engine.attach(address, PeerLink(info=outcome, agent_name=name, prep=prep))
        return outcome

    def _drop(self, address: str, why: str) -> None:
        link = self._engine.detach(address, why)
        if link is not None:
            if link.prep is not None:
                self._agent.unprep(link.prep)
            self._agent.remove_peer(link.agent_name)

    def peer_lost(self, address: str) -> None:
        """The peer is dead (lease expired): remove its agent; fail and quiesce its transfers."""
        with self._lock:
            self._drop(address, "peer lost")
        self._changed()  # the failed transfers' events: poll them now

    # ---- transfers --------------------------------------------------------------------------
    def start_push(
        self,
        transfer_id: str,
        peer: str,
        remote_runs: Runs,
        local_runs: Runs,
        timeout_s: float,
        peer_epoch: int | None = None,
        leg: LegSpec | None = None,
    ) -> TransferState:
        """WRITE ``local_runs`` into the peer's announced ``remote_runs`` (same token order);
        ``leg`` when the peer runs another TP (slices of blocks, the target's id and senders)."""
        state = self._start(
            Role.PUSH, transfer_id, peer, remote_runs, local_runs, timeout_s, peer_epoch, leg
        )
        self._changed()
        return state

    def start_pull(
        self,
        transfer_id: str,
        peer: str,
        remote_runs: Runs,
        local_runs: Runs,
        timeout_s: float,
        peer_epoch: int | None = None,
        layer_groups: Sequence[Sequence[int]] | None = None,
        leg: LegSpec | None = None,
    ) -> TransferState:
        """READ the peer's ``remote_runs`` into ``local_runs``; posts and finishes by itself."""
        with self._lock:
            self._start(
                Role.PULL, transfer_id, peer, remote_runs, local_runs, timeout_s, peer_epoch, leg
            )
            for group in layer_groups or [range(self.layout.num_layers)]:
                self._engine.push_layers(transfer_id, group)
            self._engine.finish(transfer_id)
            state = self._engine.get(transfer_id).state
        self._changed()
        return state

    def _changed(self) -> None:
        """Something needs progress soon: cut the Poller's sleep short."""
        if self.on_change is not None:
            self.on_change()

    def _start(
        self,
        role: Role,
        transfer_id: str,
        peer: str,
        remote_runs: Runs,
        local_runs: Runs,
        timeout_s: float,
        peer_epoch: int | None,
        leg: LegSpec | None,
    ) -> TransferState:
        with self._lock:
            self._check_open()
            self._link(peer, peer_epoch)
            t = self._engine.start(
                role, transfer_id, peer, remote_runs, local_runs, timeout_s, peer_epoch, leg
            )
            if t.state is TransferState.WAITING_PEER:
                self._peers.request(peer)
            return t.state

    def expect(
        self,
        transfer_id: str,
        timeout_s: float,
        peer: str | None = None,
        sender_at: dict[str, int] | None = None,
        alloc: int = 0,
    ) -> None:
        """Track a transfer the peer initiates; its notice (or the deadline) ends it.
        ``sender_at``: the side channels of several writing ranks (a peer of larger TP) by
        rank, so that ``peer_lost`` of one of them counts as that rank's last word only.
        ``alloc``: the allocation epoch a notice must echo (another one's is dropped)."""
        with self._lock:
            self._check_open()
            self._engine.expect(transfer_id, timeout_s, peer, sender_at, alloc)
        self._changed()

    def push_layers(self, transfer_id: str, layers: Sequence[int]) -> bool:
        """Post one request for ``layers``; False if the transfer no longer accepts posts
        (aborted, failed, expired, finished). KeyError for an id never started."""
        with self._lock:
            posted = self._engine.push_layers(transfer_id, layers)
        self._changed()
        return posted

    def finish(self, transfer_id: str, checksum: int | LateChecksum | None = None) -> None:
        """No more layers: the completion notice (with ``checksum``, the KV's) goes out once
        every request is DONE (and a late checksum is ready: the poller polls for it)."""
        with self._lock:
            self._engine.finish(transfer_id, checksum)
        self._changed()

    def abort(self, transfer_id: str, detail: str = "") -> None:
        """Stop posting. The ABORTED event (quiesced) is the acknowledgement."""
        with self._lock:
            self._engine.abort(transfer_id, detail)
        self._changed()

    def fail(self, transfer_id: str, reason: FailReason, detail: str = "") -> None:
        """Fail a transfer from outside (prefill failed, KvFailed arrived). A target stays
        unquiesced until the initiator's notice, ``acknowledged`` or ``peer_lost``."""
        with self._lock:
            self._engine.fail(transfer_id, reason, detail)

    def acknowledged(self, transfer_id: str, sender: int | None = None, senders: int = 1) -> None:
        """Target side: initiator rank ``sender`` (of ``senders`` writing here) confirmed over
        the bus (AbortAck, KvFailed) that nothing of this transfer is or will be in flight from
        it; same effect as its ``aborted`` notice. ``sender`` None: nothing can land from anyone
        (a pull target whose reader is finished)."""
        with self._lock:
            self._engine.acknowledged(transfer_id, sender, senders)
        self._changed()

    def poll(self) -> list[TransferEvent]:
        """Drive NIXL, advance every transfer, return what happened (terminal/quiesced)."""
        with self._lock:
            if self._closed:
                return []
            for address in self._peers.pending():
                self._settle(address)
            return self._engine.progress()

    # ---- introspection & lifecycle ----------------------------------------------------------
    def state(self, transfer_id: str) -> TransferState | None:
        """Current state; a recently ended (reaped) transfer keeps its final state."""
        with self._lock:
            t = self._engine.transfers.get(transfer_id)
            return t.state if t is not None else self._engine.ended.get(transfer_id)

    def active(self) -> int:
        with self._lock:
            return len(self._engine.transfers)

    def poll_interval(self, busy_s: float, target_s: float, idle_s: float) -> float:
        """How soon progress is needed: ``busy_s`` while a transfer's end is awaited (every
        request posted and some still live: the push tail, a pull's READ; or its done notice
        waits for a late checksum) or a handshake is
        pending; ``target_s`` while only WRITEs of a prefill still computing are live (nobody
        waits for them yet; polling them at ``busy_s`` took P's core from its forward: P's
        prefill ran up to 2.5x slower under load, docs/benchmarks/serve.md) or a notice is
        imminent (``hurry``: the initiator's WRITEs started; a target that only waits for a
        prefill to begin costs ``idle_s`` polls, not 1 kHz); ``idle_s`` otherwise."""
        with self._lock:
            live = self._agent.live_handles > 0
            wait = target_s if live else idle_s
            for t in self._engine.transfers.values():
                if t.initiator and t.state is TransferState.WAITING_PEER:
                    return busy_s
                # the notice waits for P's sums only (an aborting one sends none)
                late = t.late_checksum is not None and t.state is not TransferState.ABORTING
                if t.initiator and (live or late) and t.finish_requested and not t.state.terminal:
                    return busy_s
                if not t.initiator and not t.state.terminal and t.imminent:
                    wait = target_s
            return wait

    def hurry(self, transfer_id: str) -> None:
        """The peer started writing into this target transfer: poll for its notice at full
        rate from now on (an unknown or finished id is ignored)."""
        with self._lock:
            t = self._engine.transfers.get(transfer_id)
            if t is not None and not t.initiator:
                t.imminent = True
        self._changed()

    @property
    def live_handles(self) -> int:
        """NIXL requests not yet released, over all transfers."""
        return self._agent.live_handles

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._engine.cancel_all()
            self._server.stop()
            self._peers.close()
            for address in list(self._engine.peers):
                self._drop(address, "transport closed")
            self._agent.close()
