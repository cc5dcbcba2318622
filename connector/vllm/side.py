"""What the prefill and the decode side of the worker half share: the transfers in flight by id,
the bus messages that arrived before their transfer (bounded), this half's TP rank (``Rank``: a
side takes only the messages of peer ranks whose KV heads overlap its own, ``mine``), an
initiator's transfers with each peer rank (``Legs``: one with an equal TP, several when the peer
runs a larger TP) and the checked state transition of their per-transfer objects.

``SideBase._deliver`` is the bus-thread entry: a message for a known transfer is applied, those
for an unknown transfer are kept in ``_early`` (at most ``max_pending_announcements`` transfers,
oldest dropped; a few messages each) until ``_track`` registers the transfer and
``_apply_early`` hands them over. ``_forget`` ends the tracking.

Threading model: every method is called with ``self.lock`` held (an RLock: the bus thread and
the engine thread both enter).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.params import ConnectorSettings
from kvpush.connector.peering import peer_ranks, tp_slices
from kvpush.connector.transfer import InvalidTransition, LegSpec, TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime

MAX_EARLY_PER_TRANSFER = 64  # messages kept for a transfer not known yet (peer ranks x kinds)
Entry = TypeVar("Entry")  # Incoming or Outgoing: each has a ``deadline`` and ``legs``
Message = TypeVar("Message")
State = TypeVar("State", bound=enum.Enum)


@dataclass(frozen=True)
class Rank:
    """A worker half's place in its engine: TP rank ``index`` of ``size``. Rank r of size t
    holds KV heads [r/t, (r+1)/t) of the model's (vLLM shards heads evenly, in rank order)."""

    index: int = 0
    size: int = 1

    def overlaps(self, index: int, size: int) -> bool:
        """Do rank ``index`` of ``size`` (a peer's) and this rank hold some of the same heads?
        Same TP: only the same rank. P of 2 and D of 1: D's rank 0 and both of P's."""
        return (
            self.index * size < (index + 1) * self.size
            and index * self.size < (self.index + 1) * size
        )


@dataclass(eq=False)
class Leg:
    """One initiator transfer of a request, with one rank of the peer."""

    peer_rank: int
    transport_id: str  # the id in our transport (the request's transfer id unless several)
    spec: LegSpec
    finished: bool = False  # every layer posted and ``finish`` called (push)
    event: TransferEvent | None = None  # its quiesced terminal event


class Legs:
    """The initiator transfers of one request, one per peer rank that holds some of our KV
    heads: one with an equal TP (id = the transfer id), k when the peer's TP is k times ours
    (P of 1 pushing into D of 2; D of 1 reading from P of 2). Each reaches its target under
    the request's transfer id; the request is done when every expected leg is."""

    def __init__(self, transfer_id: str, rank: Rank) -> None:
        self.transfer_id = transfer_id
        self.rank = rank
        self.expected: int | None = None  # known with the first peer rank's message
        self.by_rank: dict[int, Leg] = {}

    def add(self, peer_rank: int, peer_tp: int, layout: str, alloc: int = 0) -> Leg:
        """The leg to ``peer_rank`` of ``peer_tp`` (``TpMismatch`` if the pair cannot map);
        ``alloc``: the allocation epoch of the peer's blocks it writes into (echoed)."""
        ours, theirs = self.rank, peer_ranks(peer_rank, peer_tp, self.rank.size)
        parts = tp_slices(ours.index, ours.size, peer_rank, peer_tp, layout)
        self.expected = len(peer_ranks(ours.index, ours.size, peer_tp))
        tid = self.transfer_id if self.expected == 1 else f"{self.transfer_id}>{peer_rank}"
        spec = LegSpec(self.transfer_id, parts, ours.index, len(theirs), alloc)
        leg = self.by_rank[peer_rank] = Leg(peer_rank, tid, spec)
        return leg

    @property
    def complete(self) -> bool:
        """Every expected leg was started."""
        return self.expected is not None and len(self.by_rank) == self.expected

    @property
    def quiet(self) -> bool:
        """Every started leg reported its quiesced end (nothing of ours in flight)."""
        return all(leg.event is not None for leg in self.by_rank.values())

    def outcome(self) -> TransferState:
        """DONE when every expected leg is; else the first leg's non-DONE state (or FAILED)."""
        states = [leg.event.state for leg in self.by_rank.values() if leg.event is not None]
        bad = [s for s in states if s is not TransferState.DONE]
        if bad:
            return bad[0]
        return TransferState.DONE if self.complete and self.quiet else TransferState.FAILED

    def summary(self) -> TransferEvent | None:
        """One event for the whole request: the legs' bytes and descriptors summed, the span
        from the first start to the last end (the last leg's per-layer timings)."""
        events = [leg.event for leg in self.by_rank.values() if leg.event is not None]
        if not events:
            return None
        last = max(events, key=lambda e: e.ended_ns)
        return TransferEvent(
            transfer_id=self.transfer_id,
            role=last.role,
            state=self.outcome(),
            quiesced=True,
            reason=next((e.reason for e in events if e.reason is not None), None),
            detail=next((e.detail for e in events if e.detail), ""),
            bytes=sum(e.bytes for e in events),
            descriptors=sum(e.descriptors for e in events),
            elapsed_ms=max(e.elapsed_ms for e in events),
            layers=last.layers,
            started_ns=min(e.started_ns for e in events),
            ended_ns=last.ended_ns,
        )


def check_transition(
    allowed: Mapping[State, frozenset[State]], current: State, new: State, what: str
) -> None:
    """Raise ``InvalidTransition`` unless ``current -> new`` is in ``allowed``."""
    if new not in allowed[current]:
        raise InvalidTransition(f"{what}: {current.value} -> {new.value}")


class SideBase(Generic[Entry, Message]):
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: KvTransport,
        bus: BusThread,
        runtime: WorkerRuntime,
        rank: Rank,
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.transport = transport
        self.bus = bus
        self.runtime = runtime
        self.lock = threading.RLock()
        self._by_tid: dict[str, Entry] = {}
        # by transfer: the messages of each peer rank (several when the peer's TP is larger)
        self._early: BoundedDict[str, list[Message]] = BoundedDict(
            settings.max_pending_announcements
        )
        # transfers already ended here: a late message of another peer rank is dropped, so
        # it cannot take an early slot from a transfer still to come
        self._ended: BoundedDict[str, bool] = BoundedDict(settings.max_pending_announcements)
        self._leg_of: dict[str, tuple[str, int]] = {}  # a leg's transport id -> (tid, peer rank)

    def mine(self, message: object) -> bool:
        """Is ``message`` (from a peer rank) for this rank? (``rank`` None: every rank.)"""
        index = getattr(message, "rank", 0)
        return index is None or self.rank.overlaps(index, getattr(message, "tp", 1))

    def _apply(self, entry: Entry, message: Message) -> None:
        raise NotImplementedError

    def _take(self, message: Any) -> None:
        """Bus thread: apply ``message`` to its transfer (or keep it for later); once applied,
        ask for a step (only a step reports what it changed)."""
        with self.lock:
            if not self._deliver(message.transfer_id, message):
                return
        self.runtime.notify()

    def _deliver(self, transfer_id: str, message: Message) -> bool:
        """Apply ``message`` to its transfer; False (kept for later) when it is not known yet."""
        entry = self._by_tid.get(transfer_id)
        if entry is None and transfer_id in self._ended:
            return False
        if entry is None:
            early = self._early.get(transfer_id) or []
            if len(early) < MAX_EARLY_PER_TRANSFER:
                self._early[transfer_id] = [*early, message]
            return False
        self._apply(entry, message)
        return True

    def _track(self, transfer_id: str, entry: Entry) -> None:
        self._by_tid[transfer_id] = entry
        self.runtime.wake_at(entry.deadline)  # a step must come then to give up on it

    def _apply_early(self, transfer_id: str, entry: Entry) -> None:
        """Hand ``entry`` the messages that came before it, in arrival order."""
        for message in self._early.pop(transfer_id, None) or []:
            self._apply(entry, message)

    def _leg_started(self, transfer_id: str, leg: Leg) -> None:
        """``leg`` of ``transfer_id`` runs in the transport: its events name it."""
        self._leg_of[leg.transport_id] = (transfer_id, leg.peer_rank)

    def _event_of(self, event: TransferEvent) -> tuple[Entry | None, int]:
        """The entry a transport event belongs to and the peer rank of its leg (-1: not a
        leg's event, e.g. a target's)."""
        tid, peer_rank = self._leg_of.get(event.transfer_id, (event.transfer_id, -1))
        return self._by_tid.get(tid), peer_rank

    def _forget(self, transfer_id: str) -> None:
        entry = self._by_tid.pop(transfer_id)
        self._ended[transfer_id] = True
        for leg in entry.legs.by_rank.values():
            self._leg_of.pop(leg.transport_id, None)
