"""``TransferEngine``: the transfer table and everything that moves a transfer along.

Owns the table ``transfer_id -> Transfer``, the attached peers (NIXL agent name, pool layout,
prepped remote list), posting (when and what; posting.py builds the requests), progress
(request status, deadlines, cancel after a grace period, end-of-transfer notices) and the
notices that end target transfers (one that echoes another allocation epoch is dropped: a stale
sender's). Rules kept here
(docs/design.md, correctness rules): a request is released only once DONE or failed (or
force-cancelled after ``cancel_grace_s`` past the end); the completion notice goes out only
after every request of the transfer is DONE; a failure becomes a terminal state at once; an
aborted/failed initiator tells the target once nothing is in flight.

Threading model: not thread-safe. ``KvTransport`` calls every method under its lock; the clock
is injectable for tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvpush.connector.agent import AgentError, NixlAgent, XferStatus
from kvpush.connector.bounded import BoundedDict
from kvpush.connector.layout import PoolLayout, Runs, check_runs, pair_runs, segment_ids
from kvpush.connector.peering import slice_diff
from kvpush.connector.posting import plan_layers, post_request
from kvpush.connector.sidechannel import TransportError
from kvpush.connector.transfer import (
    NOTICE_VERSION,
    LateChecksum,
    LegSpec,
    Notice,
    NoticeKind,
    PeerLink,
    Posted,
    Role,
    Transfer,
    TransferEvent,
    TransferState,
    notice_decoder,
    notice_encoder,
)
from kvpush.schemas.messages import FailReason

log = logging.getLogger(__name__)
_S = TransferState


class TransferEngine:
    def __init__(
        self,
        agent: NixlAgent,
        layout: PoolLayout,
        local_prep: Any | None,
        *,
        cancel_grace_s: float,
        max_transfers: int,
        max_early_notices: int,
        clock: Callable[[], float],
    ) -> None:
        self.agent = agent
        self.layout = layout
        self.local_prep = local_prep
        self.cancel_grace_s = cancel_grace_s
        self.max_transfers = max_transfers
        self.clock = clock
        self.peers: dict[str, PeerLink] = {}
        self.transfers: dict[str, Transfer] = {}
        self._early: BoundedDict[str, list[Notice]] = BoundedDict(max_early_notices)
        self.ended: BoundedDict[str, TransferState] = BoundedDict(max_transfers)  # reaped
        self._stale: list[TransferEvent] = []  # a target dropped a notice: reported next poll

    # ---- creating ---------------------------------------------------------------------------
    def _new(
        self, transfer_id: str, role: Role, peer: str | None, timeout_s: float, **fields: Any
    ) -> Transfer:
        if transfer_id in self.transfers:
            raise ValueError(f"transfer {transfer_id} already exists")
        if len(self.transfers) >= self.max_transfers:
            raise TransportError(f"too many transfers ({self.max_transfers})")
        now = self.clock()
        t = Transfer(transfer_id, role, peer, created=now, deadline=now + timeout_s, **fields)
        self.transfers[transfer_id] = t
        return t

    def start(
        self,
        role: Role,
        transfer_id: str,
        peer: str,
        remote_runs: Runs,
        local_runs: Runs,
        timeout_s: float,
        peer_epoch: int | None,
        link: LegSpec | None = None,
    ) -> Transfer:
        """A new initiator transfer; READY at once if ``peer`` is attached, else WAITING_PEER."""
        check_runs(local_runs, self.layout.num_blocks, "local")
        segments = pair_runs(local_runs, remote_runs)
        t = self._new(transfer_id, role, peer, timeout_s, peer_epoch=peer_epoch, segments=segments)
        t.leg = link or LegSpec()
        t.local_ids, t.remote_ids = segment_ids(segments, 0), segment_ids(segments, 1)
        if peer in self.peers:
            self._on_peer_ready(t, self.clock())
        return t

    def expect(
        self,
        transfer_id: str,
        timeout_s: float,
        peer: str | None,
        sender_at: dict[str, int] | None = None,
        alloc: int = 0,
    ) -> Transfer:
        senders = dict(sender_at or {})
        t = self._new(transfer_id, Role.TARGET, peer, timeout_s, sender_at=senders, alloc=alloc)
        for notice in self._early.pop(transfer_id, None) or []:
            self._take_notice(t, notice, self.clock())
        return t

    # ---- peers ------------------------------------------------------------------------------
    def waiting_for(self, address: str) -> list[Transfer]:
        return [
            t
            for t in self.transfers.values()
            if t.initiator and t.peer == address and t.state is _S.WAITING_PEER
        ]

    def attach(self, address: str, link: PeerLink) -> None:
        self.peers[address] = link
        now = self.clock()
        for t in self.waiting_for(address):
            self._on_peer_ready(t, now)

    def fail_waiting(self, address: str, reason: FailReason, detail: str) -> None:
        now = self.clock()
        for t in self.waiting_for(address):
            self._fail(t, now, reason, detail)

    def detach(self, address: str, why: str) -> PeerLink | None:
        """Forget a peer (dead or restarted): fail and quiesce every transfer bound to it."""
        now = self.clock()
        for t in self.transfers.values():
            if t.peer != address and address not in t.sender_at:
                continue
            if t.initiator and t.state is not _S.WAITING_PEER:
                self._fail(t, now, FailReason.TRANSFER, why)
                self._cancel(t)
            elif not t.initiator:
                if not t.state.terminal:
                    t.to(_S.FAILED, now, FailReason.TRANSFER, why)
                if address in t.sender_at:  # one of several writers: the others may still write
                    t.heard.setdefault(t.sender_at[address], NoticeKind.FAILED)
                    t.senders = max(t.senders, len(t.sender_at))
                else:
                    t.noticed = True
        return self.peers.pop(address, None)

    def _on_peer_ready(self, t: Transfer, now: float) -> None:
        peer = self.peers[t.peer]  # type: ignore[index]
        if t.peer_epoch is not None and peer.info.epoch != t.peer_epoch:
            self._fail(
                t,
                now,
                FailReason.HANDSHAKE,
                f"peer epoch is {peer.info.epoch}, the announcement said {t.peer_epoch}",
            )
            return
        try:
            check_runs(t.segments[:, [1, 2]].tolist(), peer.info.pool.num_blocks, "remote")
        except ValueError as exc:
            self._fail(t, now, FailReason.POST, str(exc))
            return
        remote = peer.info.pool
        mismatch = slice_diff(self.layout, remote, *t.leg.parts)
        if mismatch:  # before any request: nothing was written
            self._fail(t, now, FailReason.INCOMPATIBLE, mismatch[0])
            return
        plan_layers(t, self.layout, remote, self.local_prep is not None and peer.prep is not None)
        t.to(_S.READY, now)
        pending, t.pending = t.pending, []
        for layers in pending:
            if not self._post(t, layers, now):
                return
        self._maybe_complete(t, now)

    # ---- posting ----------------------------------------------------------------------------
    def push_layers(self, transfer_id: str, layers: Sequence[int]) -> bool:
        group = tuple(int(i) for i in layers)
        if transfer_id in self.ended:  # already ended and reported (e.g. failed meanwhile)
            return False
        t = self.get(transfer_id)
        if not t.initiator:
            raise ValueError(f"{transfer_id} is a target transfer; it does not post")
        if not t.accepts_posts or t.finish_requested:
            return False
        bad = [i for i in group if not 0 <= i < self.layout.num_layers or i in t.layers_asked]
        if bad:
            raise ValueError(f"{transfer_id}: layers {bad} out of range or already pushed")
        t.layers_asked.update(group)
        if t.state is _S.WAITING_PEER:
            t.pending.append(group)
            return True
        return self._post(t, group, self.clock())

    def _post(self, t: Transfer, layers: tuple[int, ...], now: float) -> bool:
        peer = self.peers[t.peer]  # type: ignore[index]
        ms = (now - t.created) * 1e3
        for layer in layers:
            t.timings[layer] = [ms, ms if not len(t.segments) else -1.0]
        if not len(t.segments) or not layers:
            return True
        try:
            handle, status, nbytes, descs = post_request(
                self.agent, self.layout, self.local_prep, peer, t, layers
            )
        except AgentError as exc:
            self._fail(t, now, FailReason.POST, str(exc))
            return False
        posted = Posted(handle=handle, layers=layers)
        t.requests.append(posted)
        t.nbytes += nbytes
        t.descriptors += descs
        if t.state is _S.READY:
            t.to(_S.POSTED, now)
        if status is XferStatus.DONE:
            self._request_done(t, posted, self.clock())
        return True

    def _request_done(self, t: Transfer, posted: Posted, now: float) -> None:
        posted.done = True
        merged = self.agent.telemetry_descriptors(posted.handle)
        if merged is not None:
            t.nixl_descriptors = (t.nixl_descriptors or 0) + merged
        self.agent.release(posted.handle)
        for layer in posted.layers:
            t.timings[layer][1] = (now - t.created) * 1e3

    def finish(self, transfer_id: str, checksum: int | LateChecksum | None = None) -> None:
        if transfer_id in self.ended:
            return
        t = self.get(transfer_id)
        t.finish_requested = True
        if isinstance(checksum, int) or checksum is None:
            t.checksum, t.late_checksum = checksum, None
        else:
            t.late_checksum = checksum  # the notice waits for it (polled, never waited on)
        self._maybe_complete(t, self.clock())

    def _maybe_complete(self, t: Transfer, now: float) -> None:
        if (
            t.finish_requested
            and t.state in (_S.READY, _S.POSTED)
            and not t.pending
            and all(p.done for p in t.requests)
        ):
            try:
                if not t.checksum_known():
                    return
            except Exception as exc:  # fail closed: D recomputes rather than trust unchecked KV
                self._fail(t, now, FailReason.TRANSFER, f"the KV checksum failed: {exc!r}")
                return
            if self._notify(t, NoticeKind.DONE):
                t.to(_S.DONE, now)
            else:
                self._fail(t, now, FailReason.TRANSFER, "could not send the completion notice")

    def _notify(self, t: Transfer, kind: NoticeKind) -> bool:
        peer = self.peers.get(t.peer) if t.peer else None
        if peer is None:
            return False
        t.end_notice_sent = True
        leg = t.leg
        checksum = t.checksum if kind is NoticeKind.DONE else None
        tid = leg.remote_id or t.transfer_id
        notice = Notice(NOTICE_VERSION, kind, tid, leg.sender, leg.senders, leg.alloc, checksum)
        try:
            self.agent.notify(peer.agent_name, notice_encoder.encode(notice))
        except AgentError as exc:
            log.warning(
                "transfer %s: %s notice to %s failed: %s", t.transfer_id, kind.value, t.peer, exc
            )
            return False
        return True

    # ---- ending -----------------------------------------------------------------------------
    def abort(self, transfer_id: str, detail: str) -> None:
        t = self.transfers.get(transfer_id)
        if t is None or t.state.terminal or t.state is _S.ABORTING:
            return
        t.pending.clear()
        state = _S.ABORTED if t.initiator and t.quiesced else _S.ABORTING
        t.to(state, self.clock(), FailReason.ABORTED, detail)

    def fail(self, transfer_id: str, reason: FailReason, detail: str) -> None:
        t = self.transfers.get(transfer_id)
        if t is not None:
            self._fail(t, self.clock(), reason, detail)

    def acknowledged(self, transfer_id: str, sender: int | None, senders: int) -> None:
        """The bus said sender rank ``sender`` (of ``senders``) has nothing in flight for this
        target transfer; ``None``: no sender can write into it any more (e.g. it is read)."""
        t = self.transfers.get(transfer_id)
        if t is None or t.initiator:
            return
        if sender is None:
            t.noticed = True
            sender = 0
        t.on_notice(NoticeKind.ABORTED, self.clock(), sender, senders)

    def _fail(self, t: Transfer, now: float, reason: FailReason, detail: str) -> None:
        if t.state.terminal:
            return
        log.warning("transfer %s failed (%s): %s", t.transfer_id, reason.value, detail)
        t.to(_S.FAILED, now, reason, detail)

    def _cancel(self, t: Transfer) -> None:
        for p in t.in_flight:  # release() cancels a request still running
            self.agent.release(p.handle)

    def cancel_all(self) -> None:
        for t in self.transfers.values():
            self._cancel(t)

    # ---- progress ---------------------------------------------------------------------------
    def progress(self) -> list[TransferEvent]:
        """One poller step: notices, request status, deadlines; returns the events."""
        now = self.clock()
        for sender, payload in self.agent.notifications():
            self._on_notice(sender, payload, now)
        events, self._stale = self._stale, []
        for t in list(self.transfers.values()):
            self._advance(t, now)
            event = t.event(now)
            if event is not None:
                events.append(event)
            if t.state.terminal and t.quiesced:
                del self.transfers[t.transfer_id]
                self.ended[t.transfer_id] = t.state
        return events

    def _advance(self, t: Transfer, now: float) -> None:
        if t.initiator:
            for p in t.in_flight:
                status, why = self.agent.status(p.handle)
                if status is XferStatus.DONE:
                    self._request_done(t, p, now)
                elif status is XferStatus.ERR:
                    p.done = True
                    self.agent.release(p.handle)
                    self._fail(t, now, FailReason.TRANSFER, f"a request failed: {why}")
            self._maybe_complete(t, now)
        if not t.state.terminal and now > t.deadline:
            t.to(_S.EXPIRED, now, FailReason.DEADLINE, t.detail or "deadline passed")
        if not t.initiator or not (t.state.terminal or t.state is _S.ABORTING):
            return
        if t.in_flight and t.ended_at is not None and now > t.ended_at + self.cancel_grace_s:
            log.warning(
                "transfer %s: cancelling %d requests still in flight",
                t.transfer_id,
                len(t.in_flight),
            )
            self._cancel(t)
        if t.quiesced:
            if t.state is _S.ABORTING:
                t.to(_S.ABORTED, now)
            if not t.end_notice_sent and t.state is not _S.DONE:
                self._notify(t, NoticeKind.ABORTED if t.state is _S.ABORTED else NoticeKind.FAILED)

    def _on_notice(self, sender: str, payload: bytes, now: float) -> None:
        try:
            notice = notice_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("ignoring a notification from %s that is not a kvpush notice", sender)
            return
        t = self.transfers.get(notice.transfer_id)
        if t is None:  # not expected yet (or already forgotten): keep it, bounded
            early = self._early.get(notice.transfer_id) or []
            self._early[notice.transfer_id] = [*early, notice]
            return
        if t.initiator:
            log.warning(
                "notice %s for our own initiated transfer %s from %s ignored",
                notice.kind.value,
                t.transfer_id,
                sender,
            )
            return
        self._take_notice(t, notice, now)

    def _take_notice(self, t: Transfer, notice: Notice, now: float) -> None:
        """A target's notice, unless it echoes another allocation of the target's blocks: then
        it is dropped, and reported with the next events (``stale``) for the owner to count."""
        if not t.stale(notice):
            t.on_notice(notice.kind, now, notice.sender, notice.senders, notice.checksum)
        elif len(self._stale) < self.max_transfers:
            detail = f"{notice.kind.value} notice of allocation {notice.alloc}, not {t.alloc}"
            self._stale.append(TransferEvent(t.transfer_id, t.role, t.state, False, stale=detail))

    def get(self, transfer_id: str) -> Transfer:
        t = self.transfers.get(transfer_id)
        if t is None:
            raise KeyError(f"unknown transfer {transfer_id} (never started, or ended long ago)")
        return t
