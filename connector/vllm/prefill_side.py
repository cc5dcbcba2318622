"""Prefill side of the worker half: push a request's KV into the blocks decode announced.

One ``Outgoing`` per transfer. Push mode: the announcement (``BlocksAnnounced``) may come before
the last prefill step (then each layer is WRITten as soon as ``save_kv_layer`` sees it: the push
overlaps the remaining layers) or after it (then every layer is posted at once: delayed free
keeps the blocks). Pull mode: once every layer is computed P announces its blocks (``KvReady``)
and expects D's READ. Either way the blocks are released to vLLM (``finished_sending``) only on
a quiesced terminal transport event (DESIGN §4 rule 4), after the bus heard the outcome:
KvPushed, KvFailed or AbortAck.

Threading model: ``on_*`` bus handlers run on the bus thread; ``on_work``, ``on_layer_saved``
and ``collect`` on the engine (worker) thread. Every entry point takes ``self.lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvpush.connector.layout import ids_to_runs, runs_to_ids
from kvpush.connector.params import ConnectorSettings, PrefillWork, TransferParams
from kvpush.connector.tracing import emit_span, now_ns, trace_parent, tracing_on
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime
from kvpush.schemas import subjects
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    FailReason,
    KvFailed,
    KvPushed,
    KvReady,
    Timing,
    TransferMode,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Outgoing:
    req_id: str
    params: TransferParams
    block_ids: list[int]
    num_tokens: int
    deadline: float
    completing: bool = False  # the current step computes the last prompt token
    computed: set[int] = field(default_factory=set)  # layers saved in the completing step
    announcement: BlocksAnnounced | None = None
    started: bool = False
    finished_posting: bool = False
    outcome: TransferState | None = None  # set once quiesced: blocks may be released
    req_finished: bool = False
    compute_start_ns: int = 0  # unix ns: first engine step of the request
    compute_end_ns: int = 0  # every layer of its last prompt token computed

    def timing(self, kv_sent_ns: int = 0) -> Timing:
        return Timing(
            prefill_received=self.params.received_ns,
            prefill_start=self.compute_start_ns,
            prefill_end=self.compute_end_ns,
            kv_sent=kv_sent_ns,
        )


class PrefillSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: KvTransport,
        bus: BusThread,
        runtime: WorkerRuntime,
        num_layers: int,
        block_size: int,
    ) -> None:
        self.settings = settings
        self.transport = transport
        self.bus = bus
        self.runtime = runtime
        self.num_layers = num_layers
        self.block_size = block_size
        self.lock = threading.RLock()
        self._by_tid: dict[str, Outgoing] = {}
        self._tid_of: dict[str, str] = {}  # req_id -> transfer_id
        self._early: OrderedDict[str, BlocksAnnounced | Abort] = OrderedDict()
        self._completing: list[Outgoing] = []
        bus.subscribe(subjects.blocks(settings.worker_id), self.on_bus)
        bus.subscribe(subjects.abort(settings.worker_id), self.on_bus)

    # ---- bus thread -------------------------------------------------------------------------
    def on_bus(self, subject: str, message: object) -> None:
        if not isinstance(message, (BlocksAnnounced, Abort)):
            return
        with self.lock:
            out = self._by_tid.get(message.transfer_id)
            if out is None:
                self._early[message.transfer_id] = message
                while len(self._early) > self.settings.max_pending_announcements:
                    self._early.popitem(last=False)
                return
            self._apply(out, message)

    def _apply(self, out: Outgoing, message: BlocksAnnounced | Abort) -> None:
        if isinstance(message, Abort):
            self._abort(out, message.reason)
        elif out.announcement is None and out.outcome is None:
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
                    self._by_tid[tid] = out
                    self._tid_of[item.req_id] = tid
                    self.runtime.add_pending(1)
                    early = self._early.pop(tid, None)
                    if early is not None:
                        self._apply(out, early)
                out.block_ids = item.block_ids
                if item.completes and out.outcome is None:
                    out.completing = True
                    self._completing.append(out)
                    self._maybe_start(out)

    def on_layer_saved(self, layer: int) -> bool:
        """Layer ``layer`` of this step is computed; True if WRITEs were posted for it."""
        if not self._completing:
            return False
        if self.settings.fault_layer_delay_ms:
            time.sleep(self.settings.fault_layer_delay_ms / 1000.0)
        posted = False
        with self.lock:
            for out in self._completing:
                out.computed.add(layer)
                if out.started and out.params.mode is TransferMode.PUSH:
                    posted |= self.transport.push_layers(out.params.transfer_id, [layer])
                self._maybe_finish(out)
        return posted

    def _maybe_start(self, out: Outgoing) -> None:
        if out.started or out.outcome is not None:
            return
        tid = out.params.transfer_id
        if out.params.mode is TransferMode.PULL:
            if len(out.computed) == self.num_layers:
                self._announce_ready(out)
            return
        ann = out.announcement
        if ann is None or not out.completing:
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
        out.started = True
        if out.computed:
            self.transport.push_layers(tid, sorted(out.computed))
        self._maybe_finish(out)

    def _maybe_finish(self, out: Outgoing) -> None:
        if not out.compute_end_ns and len(out.computed) == self.num_layers:
            out.compute_end_ns = now_ns()
        if out.started and not out.finished_posting and len(out.computed) == self.num_layers:
            out.finished_posting = True
            if out.params.mode is TransferMode.PUSH:
                self.transport.finish(out.params.transfer_id)
        elif out.params.mode is TransferMode.PULL and not out.started:
            self._maybe_start(out)

    def _announce_ready(self, out: Outgoing) -> None:
        tid = out.params.transfer_id
        last = -(-out.num_tokens // self.block_size)
        remaining = max(0.05, out.deadline - time.monotonic())
        self.transport.expect(tid, remaining)
        out.started = out.finished_posting = True
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
            ),
        )
        emit_span("kv.ready", out.params.traceparent, out.compute_end_ns, now_ns(), _attrs(out))

    def _abort(self, out: Outgoing, detail: str) -> None:
        if out.outcome is not None:
            return
        if out.started:
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
        if out.outcome is not None:
            return
        out.outcome = state
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
                    ),
                )
                emit_span("kv.push.done", p.traceparent, settled_ns, now_ns(), _attrs(out))
        elif state is TransferState.ABORTED:
            self._publish(p, subjects.abort(p.decode_id), AbortAck(transfer_id=tid, prefill_id=me))
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
                ),
            )
        self._trace(out, state, event, detail)

    @staticmethod
    def _trace(
        out: Outgoing, state: TransferState, event: TransferEvent | None, detail: str
    ) -> None:
        """P's spans of a settled transfer: queue, compute and (push) the WRITEs."""
        if not tracing_on():
            return
        p, attrs = out.params, _attrs(out)
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
                if out.outcome is None and not out.started:
                    if out.req_finished and not out.completing:
                        self._fail(out, FailReason.PREFILL, "request ended before its prefill")
                    elif now > out.deadline:
                        self._fail(out, FailReason.DEADLINE, "no announcement from decode in time")
                elif out.outcome is None and out.req_finished and not out.finished_posting:
                    self._abort(out, "request ended before its prefill")
                if out.outcome is not None and out.req_finished:
                    released.add(out.req_id)
                    del self._by_tid[tid]
                    self._tid_of.pop(out.req_id, None)
                    self.runtime.add_pending(-1)
            return released


def _attrs(out: Outgoing) -> dict[str, str | int]:
    return {
        "kvpush.transfer_id": out.params.transfer_id,
        "kvpush.mode": out.params.mode.value,
        "kvpush.decode_id": out.params.decode_id,
    }
