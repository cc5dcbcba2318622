"""Prefill side of the worker half: push a request's KV into the blocks decode announced.

One ``Outgoing`` per transfer. Push mode: the announcement (``BlocksAnnounced``) may come before
the last prefill step (then each layer is WRITten as soon as ``save_kv_layer`` sees it: the push
overlaps the remaining layers) or after it (then every layer is posted at once: delayed free
keeps the blocks). Pull mode: once every layer is computed P announces its blocks (``KvReady``)
and expects D's READ. Either way the blocks are released to vLLM (``finished_sending``) only on
a quiesced terminal transport event (DESIGN §4 rule 4), after the bus heard the outcome:
KvPushed, KvFailed or AbortAck.

The per-transfer object and its states are ``outgoing.Outgoing``'s.

Threading model: ``on_*`` bus handlers run on the bus thread; ``on_work``, ``on_layer_saved``
and ``collect`` on the engine (worker) thread. Every entry point takes ``self.lock``.
"""

from __future__ import annotations

import logging
import time

from kvpush.connector.layout import ids_to_runs, runs_to_ids
from kvpush.connector.params import ConnectorSettings, PrefillWork, TransferParams
from kvpush.connector.tracing import emit_span, now_ns, trace_parent
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.outgoing import (
    Outgoing,
    OutgoingState,
    emit_settled_spans,
    span_attrs,
)
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime
from kvpush.connector.vllm.side import Rank, SideBase
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    FailReason,
    KvFailed,
    KvPushed,
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
    ) -> None:
        super().__init__(settings, transport, bus, runtime, rank)
        self.num_layers = num_layers
        self.block_size = block_size
        self._tid_of: dict[str, str] = {}  # req_id -> transfer_id
        self._completing: list[Outgoing] = []
        bus.subscribe(subjects.blocks(settings.worker_id), self.on_bus)
        bus.subscribe(subjects.abort(settings.worker_id), self.on_bus)

    # ---- bus thread -------------------------------------------------------------------------
    def on_bus(self, subject: str, message: object) -> None:
        if not isinstance(message, (BlocksAnnounced, Abort)) or not self.mine(message):
            return
        with self.lock:
            if not self._deliver(message.transfer_id, message):
                return
        # an Abort or a refused announcement may have settled a transfer: only a step reports it
        self.runtime.notify()

    def _apply(self, out: Outgoing, message: BlocksAnnounced | Abort) -> None:
        if isinstance(message, Abort):
            self._abort(out, message.reason)
        elif out.announcement is None and not out.settled:
            out.announcement = message
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
                        compute_start_ns=now_ns(),
                    )
                    self._track(tid, out)
                    self._tid_of[item.req_id] = tid
                    self._apply_early(tid, out)
                out.block_ids = item.block_ids
                if item.completes and not out.settled:
                    out.completing = True
                    self._completing.append(out)
                    self._maybe_start(out)

    @property
    def completing(self) -> bool:
        """Does this step compute the last prompt token of a kvpush request?"""
        return bool(self._completing)

    def on_layer_saved(self, layer: int) -> bool:
        """Layer ``layer`` of this step is computed; True if WRITEs were posted for it."""
        if not self._completing:
            return False
        posted = False
        with self.lock:
            for out in self._completing:
                out.computed.add(layer)
                if out.state is OutgoingState.STREAMING:  # push mode only
                    posted |= self.transport.push_layers(out.params.transfer_id, [layer])
                self._maybe_finish(out)
        return posted

    def _maybe_start(self, out: Outgoing) -> None:
        if out.state is not OutgoingState.WAITING:
            return
        tid = out.params.transfer_id
        if out.params.mode is TransferMode.PULL:
            if len(out.computed) == self.num_layers:
                self._announce_ready(out)
            return
        ann = out.announcement
        if ann is None or not out.completing:
            return
        if ann.compat_hash != self.transport.compat_hash:  # refused before any WRITE
            self._fail(out, FailReason.INCOMPATIBLE, self._incompatible(ann.compat_hash, ann.tp))
            return
        first = ann.first_token // self.block_size
        last = -(-out.num_tokens // self.block_size)
        local = out.block_ids[first:last]
        if ann.num_tokens != out.num_tokens or len(local) != len(runs_to_ids(ann.block_runs)):
            self._fail(
                out,
                FailReason.INCOMPATIBLE,
                f"decode announced {ann.num_tokens} tokens / {len(runs_to_ids(ann.block_runs))}"
                f" blocks; prefill has {out.num_tokens} tokens / {len(local)} blocks",
            )
            return
        remaining = max(0.05, out.deadline - time.monotonic())
        try:
            self.transport.start_push(
                tid,
                ann.side_channel,
                ann.block_runs,
                ids_to_runs(local),
                remaining,
                ann.decode_epoch,
            )
        except Exception as exc:  # handshake or table full: tell D at once (rule 5)
            self._fail(out, FailReason.HANDSHAKE, str(exc)[:300])
            return
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
            self.transport.push_layers(tid, sorted(out.computed))
        self._maybe_finish(out)

    def _incompatible(self, theirs: str, their_tp: int) -> str:
        if their_tp != self.rank.size:
            return (
                f"decode runs tensor parallel {their_tp}, prefill {self.rank.size}: a different"
                " TP on the two sides is not supported yet; decode computes the prompt itself"
            )
        return (
            f"decode's compatibility hash {theirs} is not ours ({self.transport.compat_hash}):"
            " another model, dtype, block size or layout"
        )

    def _maybe_finish(self, out: Outgoing) -> None:
        if not out.compute_end_ns and len(out.computed) == self.num_layers:
            out.compute_end_ns = now_ns()
        if out.state is OutgoingState.STREAMING and len(out.computed) == self.num_layers:
            out.advance(OutgoingState.POSTED)
            self.transport.finish(out.params.transfer_id)
        elif out.params.mode is TransferMode.PULL and out.state is OutgoingState.WAITING:
            self._maybe_start(out)

    def _announce_ready(self, out: Outgoing) -> None:
        tid = out.params.transfer_id
        last = -(-out.num_tokens // self.block_size)
        remaining = max(0.05, out.deadline - time.monotonic())
        self.transport.expect(tid, remaining)
        self.transport.hurry(tid)  # D READs now: its notice frees our blocks
        out.advance(OutgoingState.POSTED)
        self._publish(
            out.params,
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
            ),
        )
        emit_span("kv.ready", out.params.traceparent, out.compute_end_ns, now_ns(), span_attrs(out))

    def _abort(self, out: Outgoing, detail: str) -> None:
        if out.settled:
            return
        if out.state is not OutgoingState.WAITING:
            self.transport.abort(out.params.transfer_id, detail)  # ack once quiesced
            if out.params.mode is TransferMode.PULL:
                self._release_read_blocks(out)
        else:
            self._settle(out, TransferState.ABORTED)

    def _release_read_blocks(self, out: Outgoing) -> None:
        """Pull: D only READs our blocks, so nothing can land in them; once the transfer is over
        (aborted, or D never came to read in time) they may go without D's notice."""
        self.transport.acknowledged(out.params.transfer_id)

    def _fail(self, out: Outgoing, reason: FailReason, detail: str) -> None:
        log.warning(
            "transfer %s (request %s) failed: %s %s",
            out.params.transfer_id,
            out.req_id,
            reason.value,
            detail,
        )
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
        tid, p = out.params.transfer_id, out.params
        me = self.settings.worker_id
        settled_ns = now_ns()
        if state is TransferState.DONE:
            if p.mode is TransferMode.PUSH and event is not None:
                self._publish(
                    p,
                    subjects.kv_done(p.decode_id),
                    KvPushed(
                        transfer_id=tid,
                        prefill_id=me,
                        decode_id=p.decode_id,
                        bytes=event.bytes,
                        descriptors=event.descriptors,
                        num_tokens=out.num_tokens,
                        push_ms=event.elapsed_ms,
                        layers=event.layers,
                        timing=out.timing(event.ended_ns),
                        rank=self.rank.index,
                        tp=self.rank.size,
                    ),
                )
                emit_span("kv.push.done", p.traceparent, settled_ns, now_ns(), span_attrs(out))
        elif state is TransferState.ABORTED:
            self._publish(
                p,
                subjects.abort(p.decode_id),
                AbortAck(transfer_id=tid, prefill_id=me, rank=self.rank.index, tp=self.rank.size),
            )
        else:
            self._publish(
                p,
                subjects.kv_failed(p.decode_id),
                KvFailed(
                    transfer_id=tid,
                    prefill_id=me,
                    decode_id=p.decode_id,
                    reason=reason or FailReason.TRANSFER,
                    detail=detail[:1000],
                    rank=self.rank.index,
                    tp=self.rank.size,
                ),
            )
        emit_settled_spans(out, state, event, detail)

    def _publish(self, params: TransferParams, subject: str, message: BusMessage) -> None:
        self.bus.publish(subject, message, trace_parent(params.traceparent))

    def collect(self, finished_req_ids: set[str], events: list[TransferEvent]) -> set[str]:
        """Apply transport events and finished requests; return req ids whose blocks may go."""
        with self.lock:
            for event in events:
                out = self._by_tid.get(event.transfer_id)
                if out is None:
                    continue
                if not event.quiesced:
                    if out.params.mode is TransferMode.PULL:
                        self._release_read_blocks(out)
                    continue
                self._settle(out, event.state, event.reason, event.detail, event)
            now = time.monotonic()
            for req_id in finished_req_ids:
                tid = self._tid_of.get(req_id)
                if tid is not None:
                    self._by_tid[tid].req_finished = True
            released: set[str] = set()
            for tid, out in list(self._by_tid.items()):
                if out.state is OutgoingState.WAITING:
                    if out.req_finished and not out.completing:
                        self._fail(out, FailReason.PREFILL, "request ended before its prefill")
                    elif now > out.deadline:
                        self._fail(out, FailReason.DEADLINE, "no announcement from decode in time")
                elif out.state is OutgoingState.STREAMING and out.req_finished:
                    self._abort(out, "request ended before its prefill")
                if out.settled and out.req_finished:
                    released.add(out.req_id)
                    self._forget(tid)
                    self._tid_of.pop(out.req_id, None)
            return released
