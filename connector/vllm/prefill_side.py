"""Prefill side of the worker half: push a request's KV into the blocks decode announced.

One ``Outgoing`` per transfer, with one push (``Leg``) per D rank that holds some of this rank's
KV heads: the D rank of the same index at an equal TP, k of them when D's TP is k times ours
(each gets its slice of every block); several P ranks write into one D rank when P's TP is the
larger (each its whole block into its slice of D's). Every D rank announces its own blocks.

Push mode: an announcement (``BlocksAnnounced``) may come before the last prefill step (then
each layer is WRITten as soon as ``save_kv_layer`` sees it: the push overlaps the remaining
layers) or after it (then every layer is posted at once: delayed free keeps the blocks). Pull
mode: once every layer is computed P announces its blocks (``KvReady``) and expects the READs
of every D rank that holds its heads. Either way the blocks are released to vLLM
(``finished_sending``) only on quiesced terminal transport events (docs/design.md, correctness
rule 4), after the bus heard the outcome: KvPushed, KvFailed or AbortAck. With the KV
checksum on, the block sums of every layer are taken in one pass once the last layer is
computed (``on_layer_computed``); the done notice of a push (and a KvReady) carries the checksum
(integrity.py): a push's notice goes once they are on the host, and the forward does not wait.

The per-transfer object and its states are ``outgoing.Outgoing``'s.

Threading model: ``on_*`` bus handlers run on the bus thread; ``on_work``, ``on_layer_saved``
and ``collect`` on the engine (worker) thread. Every entry point takes ``self.lock``.
"""

from __future__ import annotations

import logging
import time

from kvpush.connector.integrity import KvSums, SourceSums
from kvpush.connector.layout import ids_to_runs, runs_to_ids
from kvpush.connector.params import ConnectorSettings, PrefillWork
from kvpush.connector.peering import TpMismatch
from kvpush.connector.tracing import emit_span, now_ns, trace_parent
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.outgoing import (
    Outgoing,
    OutgoingState,
    emit_settled_spans,
    outcome_message,
    span_attrs,
)
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime
from kvpush.connector.vllm.side import Legs, Rank, SideBase
from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    FailReason,
    KvPushing,
    KvReady,
    TransferMode,
)

log = logging.getLogger(__name__)


class PrefillSide(SideBase[Outgoing, "BlocksAnnounced | Abort"]):
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: KvTransport,
        bus: BusThread,
        runtime: WorkerRuntime,
        rank: Rank,
        num_layers: int,
        block_size: int,
        kv_sums: KvSums | None = None,
    ) -> None:
        super().__init__(settings, transport, bus, runtime, rank)
        self.num_layers = num_layers
        self.block_size = block_size
        self.kv_sums = kv_sums  # None: the KV checksum is off
        self._tid_of: dict[str, str] = {}  # req_id -> transfer_id
        self._completing: list[Outgoing] = []
        bus.subscribe(subjects.blocks(settings.worker_id), self.on_bus)
        bus.subscribe(subjects.abort(settings.worker_id), self.on_bus)

    # ---- bus thread -------------------------------------------------------------------------
    def on_bus(self, subject: str, message: object) -> None:
        if isinstance(message, (BlocksAnnounced, Abort)) and self.mine(message):
            if isinstance(message, Abort) and self._ack_ended(message):
                return
            self._take(message)

    def _ack_ended(self, abort: Abort) -> bool:
        """An abort of a transfer this rank does not hold is acknowledged at once, so its
        sender frees the blocks instead of waiting for a word that never comes: one it already
        ended (quiesced and forgotten: aborted by this worker itself, say after it stalled),
        or one it never started (its request was aborted before the engine scheduled it). The
        transfer id is kept among the ended ones, so a request of it that still comes is
        aborted before any WRITE (``on_work``), and late announcements are dropped."""
        tid = abort.transfer_id
        with self.lock:
            if tid in self._by_tid:
                return False
            self._ended[tid] = True
            self._early.pop(tid, None)
        ack = AbortAck(
            transfer_id=tid,
            prefill_id=self.settings.worker_id,
            rank=self.rank.index,
            tp=self.rank.size,
        )
        self.bus.publish(subjects.abort(abort.sender), ack, span=False)
        return True

    def _apply(self, out: Outgoing, message: BlocksAnnounced | Abort) -> None:
        if isinstance(message, Abort):
            self._abort(out, message.reason)
        elif message.rank not in out.announcements and not out.settled:
            out.announcements[message.rank] = message
            self._maybe_start(out)

    # ---- engine thread ----------------------------------------------------------------------
    def on_work(self, work: list[PrefillWork]) -> None:
        with self.lock:
            self._completing = []
            for item in work:
                tid = item.params.transfer_id
                out = self._by_tid.get(tid)
                if out is None:
                    out = Outgoing(
                        item.req_id,
                        item.params,
                        item.block_ids,
                        item.num_tokens,
                        time.monotonic() + item.params.timeout_s(self.settings.transfer_timeout_s),
                        Legs(tid, self.rank),
                        compute_start_ns=now_ns(),
                    )
                    ended = tid in self._ended  # its abort came (and was acknowledged) first
                    self._track(tid, out)
                    self._tid_of[item.req_id] = tid
                    self._apply_early(tid, out)
                    if ended:
                        self._abort(out, "aborted before it started here")
                out.block_ids = item.block_ids
                if item.completes and not out.settled:
                    out.completing = True
                    self._completing.append(out)
                    self._maybe_start(out)

    @property
    def completing(self) -> bool:
        """Does this step compute the last prompt token of a kvpush request?"""
        return bool(self._completing)

    def on_layer_computed(self, layer: int) -> None:
        """Forward thread, as ``layer`` is computed and before its WRITE: count it in; with the
        last layer in, every layer's block sums are queued (on CUDA on the side stream, after an
        event of the forward's: ``SourceSums.add``)."""
        if self.kv_sums is None or not self._completing:
            return
        with self.lock:
            for out in self._completing:
                blocks = out.block_ids[: -(-out.num_tokens // self.block_size)]
                if out.sums is None or out.sums.ids != blocks:  # (recomputed elsewhere: anew)
                    out.sums = SourceSums(self.kv_sums, blocks)
                out.sums.add(layer)

    def on_layer_saved(self, layer: int) -> bool:
        """Layer ``layer`` of this step is computed; True if WRITEs were posted for it."""
        if not self._completing:
            return False
        posted = False
        with self.lock:
            for out in self._completing:
                out.computed.add(layer)
                if out.state is OutgoingState.STREAMING:  # push mode only
                    for leg in out.legs.by_rank.values():
                        posted |= self.transport.push_layers(leg.transport_id, [layer])
                self._maybe_finish(out)
        return posted

    def _maybe_start(self, out: Outgoing) -> None:
        """Start a push to every D rank that announced (once this step completes the prompt);
        pull: announce once every layer is computed."""
        if out.settled or out.stopping is not None:
            return
        if out.params.mode is TransferMode.PULL:
            if out.state is OutgoingState.WAITING and len(out.computed) == self.num_layers:
                self._announce_ready(out)
            return
        if not out.completing:
            return
        for rank, ann in sorted(out.announcements.items()):
            if rank not in out.legs.by_rank and out.stopping is None and not out.settled:
                self._start_leg(out, ann)

    def _start_leg(self, out: Outgoing, ann: BlocksAnnounced) -> None:
        tid = out.params.transfer_id
        if ann.compat_hash != self.transport.compat_hash:  # refused before any WRITE
            detail = (
                f"decode's compatibility hash {ann.compat_hash} is not ours"
                f" ({self.transport.compat_hash}): another model, dtype, block size or layout"
            )
            self._stop(out, TransferState.FAILED, FailReason.INCOMPATIBLE, detail)
            return
        first = ann.first_token // self.block_size
        last = -(-out.num_tokens // self.block_size)
        local = out.block_ids[first:last]
        announced = len(runs_to_ids(ann.block_runs))
        if ann.num_tokens != out.num_tokens or len(local) != announced:
            detail = (
                f"decode announced {ann.num_tokens} tokens / {announced} blocks; prefill has"
                f" {out.num_tokens} tokens / {len(local)} blocks"
            )
            self._stop(out, TransferState.FAILED, FailReason.INCOMPATIBLE, detail)
            return
        try:
            leg = out.legs.add(
                ann.rank, ann.tp, self.transport.config.compat.layout, ann.alloc_epoch
            )
        except TpMismatch as exc:
            detail = (
                f"decode runs tensor parallel {ann.tp}, prefill {self.rank.size}: {exc};"
                " decode computes the prompt itself"
            )
            self._stop(out, TransferState.FAILED, FailReason.INCOMPATIBLE, detail)
            return
        remaining = max(0.05, out.deadline - time.monotonic())
        try:
            self.transport.start_push(
                leg.transport_id,
                ann.side_channel,
                ann.block_runs,
                ids_to_runs(local),
                remaining,
                ann.decode_epoch,
                leg.spec,
            )
        except Exception as exc:  # handshake or table full: tell D at once (correctness rule 5)
            del out.legs.by_rank[ann.rank]
            self._stop(out, TransferState.FAILED, FailReason.HANDSHAKE, str(exc)[:300])
            return
        self._leg_started(tid, leg)
        if out.state is OutgoingState.WAITING:
            out.advance(OutgoingState.STREAMING)
            hint = KvPushing(
                transfer_id=tid,
                prefill_id=self.settings.worker_id,
                decode_id=out.params.decode_id,
                rank=self.rank.index,
                tp=self.rank.size,
            )
            self.bus.publish(subjects.kv_done(out.params.decode_id), hint, span=False)  # no trace
        if out.computed:
            self.transport.push_layers(leg.transport_id, sorted(out.computed))
        self._maybe_finish(out)

    def _stop(self, out: Outgoing, state: TransferState, reason: FailReason, detail: str) -> None:
        """Start no further leg; abort the started ones if ``state`` is ABORTED (a failure
        lets them finish: their D ranks may use what landed). Settles once they are quiet."""
        if not out.legs.by_rank:
            if state is TransferState.ABORTED:
                self._settle(out, state)
            else:
                self._fail(out, reason, detail)
            return
        if out.stopping is None or state is TransferState.ABORTED:
            out.stopping = (state, reason, detail)
        if state is TransferState.ABORTED:
            for leg in out.legs.by_rank.values():
                if leg.event is None:
                    self.transport.abort(leg.transport_id, detail)  # ack once quiesced
        self._maybe_finish(out)
        self._maybe_settle(out)

    def _maybe_finish(self, out: Outgoing) -> None:
        if not out.compute_end_ns and len(out.computed) == self.num_layers:
            out.compute_end_ns = now_ns()
        if out.state is OutgoingState.STREAMING and len(out.computed) == self.num_layers:
            for leg in out.legs.by_rank.values():
                if not leg.finished:
                    leg.finished = True
                    late = out.late_leg_checksum(leg, self.block_size)  # read once ready
                    self.transport.finish(leg.transport_id, late)
            if out.legs.complete or out.stopping is not None:
                out.advance(OutgoingState.POSTED)
        elif out.params.mode is TransferMode.PULL and out.state is OutgoingState.WAITING:
            self._maybe_start(out)

    def _maybe_settle(self, out: Outgoing) -> None:
        """Push: settle once every leg that will ever run is quiesced."""
        pushing = out.state in (OutgoingState.STREAMING, OutgoingState.POSTED)
        if out.settled or not pushing or not out.legs.quiet:
            return
        if out.stopping is None and not out.legs.complete:
            return
        summary = out.legs.summary()
        state, reason, detail = out.stopping or (out.legs.outcome(), None, "")
        if summary is not None:
            reason, detail = reason or summary.reason, detail or summary.detail
        self._settle(out, state, reason, detail, summary)

    def _announce_ready(self, out: Outgoing) -> None:
        tid = out.params.transfer_id
        last = -(-out.num_tokens // self.block_size)
        remaining = max(0.05, out.deadline - time.monotonic())
        self.transport.expect(tid, remaining)
        self.transport.hurry(tid)  # D READs now: its notice frees our blocks
        out.advance(OutgoingState.POSTED)
        self.bus.publish(
            subjects.kv_ready(out.params.decode_id),
            KvReady(
                transfer_id=tid,
                prefill_id=self.settings.worker_id,
                prefill_epoch=self.transport.epoch,
                block_runs=[tuple(r) for r in ids_to_runs(out.block_ids[:last])],
                num_tokens=out.num_tokens,
                compat_hash=self.transport.compat_hash,
                side_channel=self.transport.address,
                timing=out.timing(),
                rank=self.rank.index,
                tp=self.rank.size,
                checksums=out.ready_checksums(),
            ),
            trace_parent(out.params.traceparent),
        )
        emit_span("kv.ready", out.params.traceparent, out.compute_end_ns, now_ns(), span_attrs(out))

    def _abort(self, out: Outgoing, detail: str) -> None:
        if out.settled:
            return
        if out.params.mode is TransferMode.PUSH:
            self._stop(out, TransferState.ABORTED, FailReason.ABORTED, detail)
        elif out.state is not OutgoingState.WAITING:
            self.transport.abort(out.params.transfer_id, detail)  # ack once quiesced
            # pull: D only READs our blocks, so nothing can land in them; once the transfer is
            # over (aborted, or D never came to read in time) they may go without D's notice.
            # With two D ranks reading (D's TP twice ours) one may still read when the other
            # failed: it may then read reused blocks, but D recomputes the request (vLLM treats
            # the failed rank's blocks as invalid for the whole request): no wrong token follows
            self.transport.acknowledged(out.params.transfer_id)
        else:
            self._settle(out, TransferState.ABORTED)

    def _fail(self, out: Outgoing, reason: FailReason, detail: str) -> None:
        tid = out.params.transfer_id
        log.warning("transfer %s (request %s) failed: %s %s", tid, out.req_id, reason.value, detail)
        self._settle(out, TransferState.FAILED, reason, detail)

    def _settle(
        self,
        out: Outgoing,
        state: TransferState,
        reason: FailReason | None = None,
        detail: str = "",
        event: TransferEvent | None = None,
    ) -> None:
        """Quiesced terminal outcome: tell D (and observers), then the blocks may go."""
        if out.settled:
            return
        out.advance(OutgoingState.SETTLED, state)
        settled_ns = now_ns()
        said = outcome_message(out, state, reason, detail, event, self.settings.worker_id)
        if said is not None:
            self.bus.publish(*said, trace_parent(out.params.traceparent))
        if said is not None and state is TransferState.DONE:
            emit_span("kv.push.done", out.params.traceparent, settled_ns, now_ns(), span_attrs(out))
        emit_settled_spans(out, state, event, detail)

    def collect(self, finished_req_ids: set[str], events: list[TransferEvent]) -> set[str]:
        """Apply transport events and finished requests; return req ids whose blocks may go."""
        with self.lock:
            for event in events:
                out, d_rank = self._event_of(event)
                if out is None or event.stale:
                    continue
                if out.params.mode is TransferMode.PULL:
                    if not event.quiesced:  # over without D's notice: see ``_abort``
                        self.transport.acknowledged(out.params.transfer_id)
                    else:
                        self._settle(out, event.state, event.reason, event.detail, event)
                    continue
                leg = out.legs.by_rank.get(d_rank)
                if leg is None or not event.quiesced:
                    continue
                leg.event = event
                if event.state is not TransferState.DONE and out.stopping is None:
                    why = event.reason or FailReason.TRANSFER
                    out.stopping = (event.state, why, event.detail)
                self._maybe_settle(out)
            now = time.monotonic()
            for req_id in finished_req_ids:
                tid = self._tid_of.get(req_id)
                if tid is not None:
                    self._by_tid[tid].req_finished = True
            released: set[str] = set()
            for tid, out in list(self._by_tid.items()):
                if out.state is OutgoingState.WAITING:  # (a layer never handed over: no KV)
                    if out.req_finished and len(out.computed) < self.num_layers:
                        self._fail(out, FailReason.PREFILL, "request ended before its prefill")
                    elif now > out.deadline:
                        self._fail(out, FailReason.DEADLINE, "no announcement from decode in time")
                elif out.state is OutgoingState.STREAMING:  # push; some D rank may not have come
                    if out.req_finished and len(out.computed) < self.num_layers:
                        self._abort(out, "request ended before its prefill")
                    elif out.stopping is None and now > out.deadline:
                        missing = "no announcement from every decode rank in time"
                        self._stop(out, TransferState.FAILED, FailReason.DEADLINE, missing)
                if out.settled and out.req_finished:
                    released.add(out.req_id)
                    self._forget(tid)
                    self._tid_of.pop(out.req_id, None)
            return released
