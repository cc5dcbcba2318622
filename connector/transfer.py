"""Transfers: one object per transfer_id with an enum state; every transition lives here.

Roles: ``PUSH`` (we WRITE into a peer's announced blocks), ``PULL`` (we READ a peer's blocks),
``TARGET`` (the passive side: its blocks are written or read by the peer; it learns the end
from a NIXL notification). States::

    WAITING_PEER --> READY --> POSTED --> DONE
         |             |         |
         +-------------+---------+--> ABORTING --> ABORTED
         +-------------+---------+--> FAILED | EXPIRED | ABORTED

- initiator: WAITING_PEER while the handshake runs, READY once the peer is loaded, POSTED after
  the first request. DONE after ``finish`` once every request is DONE *and* the completion notice
  was sent. ABORTING while aborted requests are still in flight.
- target: WAITING_PEER until the initiator's notice: ``done`` -> DONE, ``aborted`` -> ABORTED,
  ``failed`` -> FAILED. A local ``abort`` moves it to ABORTING until the initiator's ack.
  With a different TP on the two sides several initiator ranks write into one target (P of
  TP 2 -> D of TP 1): each notice names its sender rank and how many senders the target has;
  the target is DONE once every sender said done, and quiesced once every sender said anything.

``quiesced`` is separate from the state (docs/design.md, correctness rules 3 and 4): an
initiator is quiesced when no request of the transfer is in flight (all released); a target when
the initiator said it is finished (any notice) or the peer was declared lost. Failures are
reported at once (the event carries ``quiesced=False`` if requests are still in flight) and a
second event follows when the transfer quiesces; only then may blocks be freed or reused.

Also here: ``LegSpec`` (how an initiator transfer meets its target when TP differs),
``PeerLink`` (a peer loaded into NIXL), the values ``TransferEngine`` keeps with its transfers,
and ``LateChecksum``: a DONE notice's KV checksum still being computed when ``finish`` is called
(the notice waits for it, not the caller).

Threading model: none here; ``Transfer`` objects are owned by ``TransferEngine`` (engine.py),
which mutates them only under its lock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np

from kvpush.connector.agent import XferHandle
from kvpush.connector.layout import WHOLE, Slice
from kvpush.connector.sidechannel import PeerInfo
from kvpush.connector.tracing import monotonic_to_ns
from kvpush.schemas.messages import FailReason, LayerTiming

NOTICE_VERSION = 1


class TransferState(str, enum.Enum):
    WAITING_PEER = "waiting_peer"
    READY = "ready"
    POSTED = "posted"
    ABORTING = "aborting"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {TransferState.DONE, TransferState.FAILED, TransferState.ABORTED, TransferState.EXPIRED}
)
_S = TransferState
_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    _S.WAITING_PEER: frozenset({_S.READY, _S.ABORTING, *_TERMINAL}),
    _S.READY: frozenset({_S.POSTED, _S.ABORTING, *_TERMINAL}),
    _S.POSTED: frozenset({_S.ABORTING, *_TERMINAL}),
    _S.ABORTING: frozenset({_S.ABORTED, _S.FAILED, _S.EXPIRED}),
    **{s: frozenset() for s in _TERMINAL},
}


class Role(str, enum.Enum):
    PUSH = "push"
    PULL = "pull"
    TARGET = "target"


class NoticeKind(str, enum.Enum):
    DONE = "done"  # every request of the transfer completed
    ABORTED = "aborted"  # aborted; nothing in flight, nothing more will come
    FAILED = "failed"  # failed or expired; nothing in flight, nothing more will come


class Notice(msgspec.Struct, frozen=True, array_like=True):
    """The NIXL notification payload, JSON: ``[1, "done", "<transfer_id>", 0, 1]``: the
    target's transfer id, the sender's TP rank and how many ranks send to this target; then,
    when set, the target's allocation epoch (BlocksAnnounced's ``alloc_epoch``, echoed: a
    target takes notices of its own allocation only) and the KV checksum of what the sender
    wrote (``done`` only; connector/integrity.py). A decoder of fewer fields ignores the rest."""

    version: int
    kind: NoticeKind
    transfer_id: str
    sender: int = 0
    senders: int = 1
    alloc: int = 0
    checksum: int | None = None


class _NoticeEncoder:
    """A ``Notice`` as JSON without its unset trailing fields (``[1, "done", "tx", 0, 1]``)."""

    _json = msgspec.json.Encoder()

    def encode(self, notice: Notice) -> bytes:
        values = msgspec.structs.astuple(notice)
        if notice.checksum is None:
            values = values[:-1] if notice.alloc else values[:-2]
        return self._json.encode(values)


notice_encoder = _NoticeEncoder()
notice_decoder = msgspec.json.Decoder(Notice)


class TransferEvent(msgspec.Struct, frozen=True):
    """What ``poll()`` reports: a terminal state reached, or a terminal transfer quiesced."""

    transfer_id: str
    role: Role
    state: TransferState
    quiesced: bool
    reason: FailReason | None = None
    detail: str = ""
    bytes: int = 0
    descriptors: int = 0
    nixl_descriptors: int | None = None  # what NIXL posted after its merge (telemetry on)
    elapsed_ms: float = 0.0
    layers: list[LayerTiming] = []
    started_ns: int = 0  # unix ns: the transfer was created / reached its terminal state
    ended_ns: int = 0
    checksums: dict[int, int | None] = {}  # target DONE: each sender rank's (None: it sent none)
    stale: str = ""  # not an end: a notice of another allocation was dropped (what it was)


class InvalidTransition(RuntimeError):
    pass


@dataclass(eq=False)
class Posted:
    """One NIXL request of a transfer and the layers it carries."""

    handle: XferHandle
    layers: tuple[int, ...]
    done: bool = False


class LateChecksum(Protocol):
    """A DONE notice's checksum whose sums are still on their way (P's side-stream pass):
    ``ready`` must not block; ``value`` is read once, after ``ready`` said True."""

    def ready(self) -> bool: ...

    def value(self) -> int | None: ...


@dataclass(eq=False)
class Transfer:
    transfer_id: str
    role: Role
    peer: str | None  # the peer's side-channel address (targets: optional)
    created: float
    deadline: float
    peer_epoch: int | None = None
    leg: LegSpec = field(default_factory=lambda: LegSpec())  # initiator: how it meets its target
    state: TransferState = TransferState.WAITING_PEER
    reason: FailReason | None = None
    detail: str = ""
    ended_at: float | None = None
    # initiator side
    segments: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    local_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    remote_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    local_index: list[np.ndarray] | None = None  # per layer, rows of the prepped local list
    remote_index: list[np.ndarray] | None = None
    layer_descs: list[int] = field(default_factory=list)  # descriptors per layer
    layer_nbytes: list[int] = field(default_factory=list)
    requests: list[Posted] = field(default_factory=list)
    pending: list[tuple[int, ...]] = field(default_factory=list)
    layers_asked: set[int] = field(default_factory=set)
    finish_requested: bool = False
    imminent: bool = False  # target: the initiator said its WRITEs started
    end_notice_sent: bool = False
    checksum: int | None = None  # initiator: what the DONE notice carries (``finish``)
    late_checksum: LateChecksum | None = None  # ... until it is known (``checksum_known``)
    nbytes: int = 0
    descriptors: int = 0
    nixl_descriptors: int | None = None
    timings: dict[int, list[float]] = field(default_factory=dict)
    # target side
    noticed: bool = False  # set alone when the peer is lost: nothing more can land
    heard: dict[int, NoticeKind] = field(default_factory=dict)  # sender rank -> its word
    senders: int = 1  # how many ranks write into this target (the notices say)
    sender_at: dict[str, int] = field(default_factory=dict)  # writers' addresses -> rank
    alloc: int = 0  # the allocation epoch its notices must echo (0: any)
    sums: dict[int, int | None] = field(default_factory=dict)  # sender rank -> its checksum
    # reporting
    reported: tuple[TransferState, bool] | None = None

    # ---- the only place states change ----------------------------------------------------
    def to(
        self, state: TransferState, now: float, reason: FailReason | None = None, detail: str = ""
    ) -> None:
        if state is self.state:
            return
        if state not in _ALLOWED[self.state]:
            raise InvalidTransition(f"{self.transfer_id}: {self.state.value} -> {state.value}")
        self.state = state
        if reason is not None:
            self.reason = reason
        if detail:
            self.detail = detail[:1000]
        if state.terminal:
            self.ended_at = now
            self.pending.clear()

    def checksum_known(self) -> bool:
        """Initiator: is the DONE notice's checksum known? A late one is read once it is ready
        (raises what computing it raised)."""
        late = self.late_checksum
        if late is None:
            return True
        if not late.ready():
            return False
        self.checksum, self.late_checksum = late.value(), None
        return True

    # ---- derived ----------------------------------------------------------------------------
    @property
    def initiator(self) -> bool:
        return self.role is not Role.TARGET

    @property
    def in_flight(self) -> list[Posted]:
        return [p for p in self.requests if not p.handle.released]

    @property
    def quiesced(self) -> bool:
        if self.initiator:
            return not self.in_flight
        return self.noticed or len(self.heard) >= self.senders

    @property
    def accepts_posts(self) -> bool:
        return self.state in (TransferState.WAITING_PEER, TransferState.READY, TransferState.POSTED)

    def event(self, now: float) -> TransferEvent | None:
        """The event to report now, if the (terminal state, quiesced) pair changed."""
        if not self.state.terminal:
            return None
        key = (self.state, self.quiesced)
        if key == self.reported:
            return None
        self.reported = key
        return TransferEvent(
            transfer_id=self.transfer_id,
            role=self.role,
            state=self.state,
            quiesced=self.quiesced,
            reason=self.reason,
            detail=self.detail,
            bytes=self.nbytes,
            descriptors=self.descriptors,
            nixl_descriptors=self.nixl_descriptors,
            elapsed_ms=round(((self.ended_at or now) - self.created) * 1e3, 3),
            layers=[
                LayerTiming(layer=k, posted_ms=round(v[0], 3), done_ms=round(v[1], 3))
                for k, v in sorted(self.timings.items())
                if v[1] >= 0
            ],
            started_ns=monotonic_to_ns(self.created, now),
            ended_ns=monotonic_to_ns(self.ended_at or now, now),
            checksums=dict(self.sums) if self.state is TransferState.DONE else {},
        )

    # ---- notices from the initiator (target side) ---------------------------------------------
    def stale(self, notice: Notice) -> bool:
        """Is ``notice`` from a sender of another allocation of these blocks (an older
        announcement of the transfer: its WRITEs are not the ones this target waits for)?"""
        return bool(self.alloc and notice.alloc and notice.alloc != self.alloc)

    def on_notice(
        self,
        kind: NoticeKind,
        now: float,
        sender: int = 0,
        senders: int = 1,
        checksum: int | None = None,
    ) -> None:
        """Sender rank ``sender`` (of ``senders`` writing here) is finished with this transfer.
        A sender's failure or abort ends the transfer at once (unquiesced while a sibling may
        still write); DONE needs every sender's done."""
        self.senders = max(1, senders)
        self.heard.setdefault(sender, kind)
        if kind is NoticeKind.DONE:
            self.sums.setdefault(sender, checksum)
        if self.state is TransferState.WAITING_PEER:
            if kind is NoticeKind.ABORTED:
                self.to(TransferState.ABORTED, now, FailReason.ABORTED, "aborted by the peer")
            elif kind is NoticeKind.FAILED:
                self.to(TransferState.FAILED, now, FailReason.TRANSFER, "the peer reported failure")
            elif self.quiesced and all(k is NoticeKind.DONE for k in self.heard.values()):
                self.to(TransferState.DONE, now)
        elif self.state is TransferState.ABORTING and self.quiesced:
            self.to(TransferState.ABORTED, now, FailReason.ABORTED)
        # terminal already (EXPIRED/FAILED locally): only ``heard`` changes


class LegSpec(msgspec.Struct, frozen=True):
    """How one initiator transfer meets its target (defaults: equal TP, no allocation epoch):
    the target's transfer id, the (our, their) slices of each block, our rank among the
    ``senders`` ranks that write into that target, the allocation epoch to echo."""

    remote_id: str = ""
    parts: tuple[Slice, Slice] = (WHOLE, WHOLE)
    sender: int = 0
    senders: int = 1
    alloc: int = 0  # the target's allocation epoch (its announcement's), echoed in notices


@dataclass(eq=False)
class PeerLink:
    """A peer loaded into NIXL: what its side channel said, its agent name, its prepped list."""

    info: PeerInfo
    agent_name: str
    prep: Any | None
