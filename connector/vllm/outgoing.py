"""One push or pull of the prefill side: ``Outgoing``, its states and its spans.

States (one transition method, ``Outgoing.advance``)::

    WAITING --> STREAMING --> POSTED --> SETTLED
       |            |                      ^
       +------------+----------------------+   (pull: WAITING --> POSTED at KvReady)

WAITING: computing, or waiting for D's announcement (push) / the last layer (pull). STREAMING:
the push started (to at least one D rank: ``legs``), each layer is written as soon as it is
computed. POSTED: every layer posted to every D rank and the completion notices asked for
(push), or KvReady sent and D READs (pull). SETTLED: a quiesced outcome (``outcome``) is known
and D was told; the blocks go once the request ended. ``stopping`` (an abort or a failure after
the push started) keeps the state and starts no further leg: the outcome follows once every
started leg is quiesced.

``outcome_message`` is what P tells D when a transfer settles (echoing D's allocation epoch);
``emit_settled_spans`` makes P's spans of a settled transfer after the fact. ``sums`` holds the
KV checksum's block sums once the last layer is computed (``integrity.SourceSums``):
``late_leg_checksum`` is what a push's done notice carries (a ``LegChecksum``, read once they
are on the host), ``ready_checksums`` what KvReady does.

Threading model: none; ``PrefillSide`` owns these objects and changes them under its lock. A
``LegChecksum`` holds what it reads (the sums, set once, and values) and is read under the
transport's lock (its poller, or the thread that calls ``finish``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.connector.integrity import SourceSums, checksum, part_checksums
from kvpush.connector.layout import Slice
from kvpush.connector.params import TransferParams
from kvpush.connector.tracing import emit_span, now_ns, tracing_on
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.vllm.side import Leg, Legs, check_transition
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    AbortAck,
    BlocksAnnounced,
    FailReason,
    KvFailed,
    KvPushed,
    Timing,
    TransferMode,
)


class OutgoingState(str, enum.Enum):
    WAITING = "waiting"
    STREAMING = "streaming"
    POSTED = "posted"
    SETTLED = "settled"


_O = OutgoingState
_ALLOWED: dict[OutgoingState, frozenset[OutgoingState]] = {
    _O.WAITING: frozenset({_O.STREAMING, _O.POSTED, _O.SETTLED}),
    _O.STREAMING: frozenset({_O.POSTED, _O.SETTLED}),
    _O.POSTED: frozenset({_O.SETTLED}),
    _O.SETTLED: frozenset(),
}


@dataclass(frozen=True)
class LegChecksum:
    """A push leg's checksum for its done notice (``transfer.LateChecksum``): from block
    ``first_block`` on (D's hit), slice ``part`` of each; None without D's announcement."""

    sums: SourceSums
    first_block: int | None
    part: Slice

    def ready(self) -> bool:
        return self.sums.ready()

    def value(self) -> int | None:
        sums = self.sums.value()
        if sums is None or self.first_block is None:
            return None
        return checksum(sums, self.first_block, self.part)


@dataclass(eq=False)
class Outgoing:
    req_id: str
    params: TransferParams
    block_ids: list[int]
    num_tokens: int
    deadline: float
    legs: Legs
    completing: bool = False  # the current step computes the last prompt token
    computed: set[int] = field(default_factory=set)  # layers saved in the completing step
    announcements: dict[int, BlocksAnnounced] = field(default_factory=dict)  # by D rank
    stopping: tuple[TransferState, FailReason, str] | None = None  # aborted/failed mid-push
    state: OutgoingState = OutgoingState.WAITING
    outcome: TransferState | None = None  # set with SETTLED: blocks may be released
    req_finished: bool = False
    compute_start_ns: int = 0  # unix ns: first engine step of the request
    compute_end_ns: int = 0  # every layer of its last prompt token computed
    sums: SourceSums | None = None  # the KV checksum's block sums (None: checksum off)

    def advance(self, new: OutgoingState, outcome: TransferState | None = None) -> None:
        """The one state transition (``InvalidTransition`` if the diagram has no such edge)."""
        check_transition(_ALLOWED, self.state, new, f"outgoing {self.params.transfer_id}")
        self.state = new
        if new is OutgoingState.SETTLED:
            self.outcome = outcome

    @property
    def settled(self) -> bool:
        return self.state is OutgoingState.SETTLED

    @property
    def alloc_epoch(self) -> int:
        """D's allocation epoch of the blocks announced (every rank's the same; 0: none)."""
        return next((a.alloc_epoch for a in self.announcements.values()), 0)

    def late_leg_checksum(self, leg: Leg, block_size: int) -> LegChecksum | None:
        """The checksum of what ``leg`` writes (our blocks from D's hit on, our slice of each),
        for its done notice once the sums are on the host (a ``transfer.LateChecksum``, read on
        the transport's poller; None: the checksum is off)."""
        if self.sums is None:
            return None
        announced = self.announcements.get(leg.peer_rank)
        first = None if announced is None else announced.first_token // block_size
        return LegChecksum(self.sums, first, leg.spec.parts[0])

    def ready_checksums(self) -> list[int] | None:
        """KvReady's: one checksum per equal byte part of a block, over every block."""
        sums = self.sums.value() if self.sums is not None else None
        return None if sums is None else part_checksums(sums)

    def timing(self, kv_sent_ns: int = 0) -> Timing:
        return Timing(
            prefill_received=self.params.received_ns,
            prefill_start=self.compute_start_ns,
            prefill_end=self.compute_end_ns,
            kv_sent=kv_sent_ns,
        )


def outcome_message(
    out: Outgoing,
    state: TransferState,
    reason: FailReason | None,
    detail: str,
    event: TransferEvent | None,
    prefill_id: str,
) -> tuple[str, BusMessage] | None:
    """(subject, message) P's rank (``out.legs.rank``) publishes for a settled transfer: KvPushed
    (push done), AbortAck, KvFailed; None for a finished pull (D's READ notice said it all)."""
    p, tid = out.params, out.params.transfer_id
    rank, tp = out.legs.rank.index, out.legs.rank.size
    if state is TransferState.DONE:
        if p.mode is not TransferMode.PUSH or event is None:
            return None
        pushed = KvPushed(
            transfer_id=tid,
            prefill_id=prefill_id,
            decode_id=p.decode_id,
            bytes=event.bytes,
            descriptors=event.descriptors,
            num_tokens=out.num_tokens,
            push_ms=event.elapsed_ms,
            layers=event.layers,
            timing=out.timing(event.ended_ns),
            rank=rank,
            tp=tp,
            alloc_epoch=out.alloc_epoch,
        )
        return subjects.kv_done(p.decode_id), pushed
    if state is TransferState.ABORTED:
        alloc = out.alloc_epoch
        ack = AbortAck(transfer_id=tid, prefill_id=prefill_id, rank=rank, tp=tp, alloc_epoch=alloc)
        return subjects.abort(p.decode_id), ack
    failed = KvFailed(
        transfer_id=tid,
        prefill_id=prefill_id,
        decode_id=p.decode_id,
        reason=reason or FailReason.TRANSFER,
        detail=detail[:1000],
        rank=rank,
        tp=tp,
        alloc_epoch=out.alloc_epoch,
    )
    return subjects.kv_failed(p.decode_id), failed


def emit_settled_spans(
    out: Outgoing, state: TransferState, event: TransferEvent | None, detail: str
) -> None:
    """P's spans of a settled transfer: queue, compute and (push) the WRITEs."""
    if not tracing_on():
        return
    p, attrs = out.params, span_attrs(out)
    error = None if state is TransferState.DONE else f"{state.value}: {detail}"[:300]
    emit_span("prefill.queue", p.traceparent, p.received_ns, out.compute_start_ns, attrs)
    emit_span(
        "prefill.compute",
        p.traceparent,
        out.compute_start_ns,
        out.compute_end_ns or now_ns(),
        {**attrs, "gen_ai.usage.input_tokens": out.num_tokens},
    )
    if p.mode is TransferMode.PUSH and event is not None and event.started_ns:
        layers = [
            ("layer", event.started_ns + int(lt.done_ms * 1e6), {"layer": lt.layer})
            for lt in event.layers
        ]
        emit_span(
            "kv.push",
            p.traceparent,
            event.started_ns,
            event.ended_ns,
            {**attrs, "kvpush.bytes": event.bytes, "kvpush.descriptors": event.descriptors},
            layers,
            error,
        )


def span_attrs(out: Outgoing) -> dict[str, str | int]:
    return {
        "kvpush.transfer_id": out.params.transfer_id,
        "kvpush.mode": out.params.mode.value,
        "kvpush.decode_id": out.params.decode_id,
    }
