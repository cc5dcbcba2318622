"""Decode side of the worker half: announce blocks, receive KV, fall back when it does not come.

One ``Incoming`` per transfer. Push mode: ``expect`` the transfer, then announce the blocks for
tokens [first_token, num_tokens) on ``kvpush.v1.blocks.<P>``; the NIXL completion notices make
the transport report DONE (one notice per P rank that writes here: k when P's TP is k times
ours). Pull mode: wait for ``KvReady`` of every P rank that holds some of our KV heads and READ
each one's blocks (one ``Leg`` per P rank; a P of smaller TP gives each D rank a slice).
A receive is reported to vLLM (``finished_recving``; plus ``failed_recving`` for a fallback)
only on a quiesced terminal event: DONE, P's notice or AbortAck / KvFailed (no WRITE in flight or to
come), or P declared dead (its side channel stopped answering after an abort went unanswered).
A late WRITE into reused blocks therefore cannot happen (docs/design.md, correctness rule 3).
A DONE receive is reported finished only once its landed KV matches P's checksum (else failed:
D computes the prompt; ``verify.py``); words of another allocation epoch are dropped.
A request that
asked for P's first token (``first_token_from_prefill``) is reported once its KV landed and
P's ``FirstToken`` came (``first_token_wait_s`` at most), the token going up with it
(``take_first_tokens``: the scheduler half makes it the request's last prompt token). The
probes of silent peers are ``probes.ProbingMixin``'s.

The per-transfer object and its states are ``incoming.Incoming``'s.

Threading model: ``on_bus`` runs on the bus thread, ``on_work``/``collect`` on
the engine thread; all take ``self.lock``. The liveness probe of a silent peer runs on a
short-lived thread and reports back through ``self.lock``.
"""

from __future__ import annotations

import logging
import time

from kvpush.connector.integrity import IntegrityCounts, KvSums
from kvpush.connector.layout import ids_to_runs, runs_to_ids
from kvpush.connector.params import ConnectorSettings, DecodeWork, PrefillToken, ReceiveKind
from kvpush.connector.peering import TpMismatch, peer_ranks
from kvpush.connector.tracing import emit_span, now_ns, trace_parent, tracing_on
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.transport import KvTransport
from kvpush.connector.vllm.incoming import Incoming, IncomingState
from kvpush.connector.vllm.probes import ProbingMixin
from kvpush.connector.vllm.runtime import BusThread, WorkerRuntime
from kvpush.connector.vllm.side import Legs, Rank, SideBase
from kvpush.connector.vllm.verify import VerifyMixin, integrity_attrs
from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    Abort,
    AbortAck,
    BlocksAnnounced,
    FirstToken,
    KvFailed,
    KvPushed,
    KvPushing,
    KvReady,
)

log = logging.getLogger(__name__)


class DecodeSide(
    ProbingMixin, VerifyMixin, SideBase[Incoming, "KvReady | KvFailed | AbortAck | FirstToken"]
):
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: KvTransport,
        bus: BusThread,
        runtime: WorkerRuntime,
        rank: Rank,
        block_size: int,
        kv_sums: KvSums | None = None,
    ) -> None:
        super().__init__(settings, transport, bus, runtime, rank)
        self.block_size = block_size
        self.kv_sums = kv_sums  # None: the KV checksum is off
        self.integrity = IntegrityCounts()
        self._probing: set[str] = set()  # suspected peers being probed
        self._first_tokens: dict[str, PrefillToken] = {}  # by request: reported this step
        for subject in (subjects.kv_ready, subjects.kv_failed, subjects.abort, subjects.kv_done):
            bus.subscribe(subject(settings.worker_id), self.on_bus)

    # ---- bus thread -------------------------------------------------------------------------
    def on_bus(self, subject: str, message: object) -> None:
        """KvReady, KvFailed, AbortAck: for the receive. KvPushing: P's WRITEs started, poll for
        the notice at full rate now. KvPushed is P's report (the NIXL notice already completed
        the receive): its instants go to the marks table for the request's TokenChunk.
        FirstToken: the token P sampled, which a receive that asked for it waits for (every
        rank: P's service sends it once)."""
        if isinstance(message, FirstToken):
            self._take(message)
        elif not self.mine(message):
            return
        elif isinstance(message, (KvReady, KvFailed, AbortAck)):
            self._take(message)
        elif isinstance(message, KvPushing):
            self.transport.hurry(message.transfer_id)
        elif isinstance(message, KvPushed):
            self.runtime.marks.record_timing(message.transfer_id, message.timing)

    def _apply(self, inc: Incoming, message: KvReady | KvFailed | AbortAck | FirstToken) -> None:
        tid = inc.work.params.transfer_id
        if isinstance(message, FirstToken):
            inc.prefill_token = message
            return
        if inc.settled:  # reported soon (it waits for P's token): late word changes nothing
            return
        pull = inc.work.kind is ReceiveKind.PULL
        if isinstance(message, KvReady):
            self.runtime.marks.record_timing(tid, message.timing)
            inc.ready_sums.setdefault(message.rank, message.checksums)
            receiving = inc.state in (IncomingState.WAITING, IncomingState.RECEIVING)
            if pull and receiving and message.rank not in inc.legs.by_rank:
                self._start_pull(inc, message)
            return
        if self._other_allocation(inc, message):
            return
        if isinstance(message, KvFailed):
            log.warning(
                "transfer %s: prefill reported %s: %s", tid, message.reason.value, message.detail
            )
        senders = len(peer_ranks(self.rank.index, self.rank.size, message.tp))
        if pull and inc.legs.by_rank and message.rank not in inc.legs.by_rank:
            self._abort(inc, "a prefill rank gave up before its KvReady")  # stop our READs
        elif inc.started:  # P's rank is quiesced when it sends KvFailed or AbortAck
            self.transport.acknowledged(tid, message.rank, senders)
        elif isinstance(message, KvFailed):  # pull before any KvReady: drop every P rank's side
            self._give_up(inc, f"prefill rank {message.rank} failed")
        else:
            self._settle(inc, TransferState.ABORTED)

    def _start_pull(self, inc: Incoming, ready: KvReady) -> None:
        w = inc.work
        first = w.first_token // self.block_size
        remote = runs_to_ids(ready.block_runs)[first:]
        if ready.compat_hash != self.transport.compat_hash:
            self._give_up(
                inc,
                f"prefill's compatibility hash {ready.compat_hash} is not ours"
                f" ({self.transport.compat_hash})",
            )
            return
        if ready.num_tokens != w.num_tokens or len(remote) != len(w.block_ids):
            self._give_up(
                inc,
                f"KvReady does not fit ({ready.num_tokens} tokens, {len(remote)} blocks;"
                f" want {w.num_tokens}, {len(w.block_ids)})",
            )
            return
        try:
            leg = inc.legs.add(ready.rank, ready.tp, self.transport.config.compat.layout)
        except TpMismatch as exc:
            self._give_up(inc, f"prefill runs tensor parallel {ready.tp}: {exc}")
            return
        inc.peer = inc.peer or ready.side_channel
        if inc.state is IncomingState.WAITING:
            inc.advance(IncomingState.RECEIVING)
        try:
            self.transport.start_pull(
                leg.transport_id,
                ready.side_channel,
                ids_to_runs(remote),
                ids_to_runs(w.block_ids),
                max(0.05, inc.deadline - time.monotonic()),
                ready.prefill_epoch,
                leg=leg.spec,
            )
        except Exception as exc:  # nothing was posted: no READ can land later
            del inc.legs.by_rank[ready.rank]
            self._give_up(inc, f"pull failed to start: {exc}")
            return
        self._leg_started(w.params.transfer_id, leg)

    def _give_up(self, inc: Incoming, why: str) -> None:
        """Pull cannot go on: compute locally. Nothing posted yet: settle now; else stop the
        READs already posted (settled once they are quiet)."""
        log.warning("transfer %s: %s: computing locally", inc.work.params.transfer_id, why)
        if inc.legs.by_rank:
            self._abort(inc, why)
            return
        self._tell_prefill(inc.work, f"{why}: decode computes this prompt locally")
        self._settle(inc, TransferState.FAILED)

    # ---- engine thread ----------------------------------------------------------------------
    def on_work(self, work: list[DecodeWork]) -> None:
        with self.lock:
            for item in work:
                tid = item.params.transfer_id
                if item.kind is ReceiveKind.LOCAL:
                    self._tell_prefill(item, "decode computes this prompt locally")
                    self._ended[tid] = True  # P's late messages (FirstToken) are dropped
                    self._early.pop(tid, None)
                elif item.kind is ReceiveKind.ABORT:
                    inc = self._by_tid.get(tid)
                    if inc is not None:
                        inc.request_ended = True
                        self._abort(inc, "request ended")
                else:
                    self._receive(item)

    def _receive(self, item: DecodeWork) -> None:
        tid = item.params.transfer_id
        timeout = item.params.timeout_s(self.settings.transfer_timeout_s)
        peer = item.params.prefill_address_of(self.rank.index, self.rank.size)
        writers = self._writers(item.params.prefill_addresses)
        inc = Incoming(item, time.monotonic() + timeout, Legs(tid, self.rank), peer, list(writers))
        self._track(tid, inc)
        started_ns = now_ns()
        if item.kind is ReceiveKind.PUSH:
            several = writers if len(writers) > 1 else None  # P of larger TP: count each rank
            alloc = {"alloc": item.alloc_epoch} if item.alloc_epoch else {}  # 0: take any
            self.transport.expect(tid, timeout, peer=peer, sender_at=several, **alloc)
            inc.advance(IncomingState.RECEIVING)
            self.bus.publish(
                subjects.blocks(item.params.prefill_id),
                BlocksAnnounced(
                    transfer_id=tid,
                    decode_id=self.settings.worker_id,
                    decode_epoch=self.transport.epoch,
                    block_runs=[tuple(r) for r in ids_to_runs(item.block_ids)],
                    first_token=item.first_token,
                    num_tokens=item.num_tokens,
                    compat_hash=self.transport.compat_hash,
                    side_channel=self.transport.address,
                    rank=self.rank.index,
                    tp=self.rank.size,
                    alloc_epoch=item.alloc_epoch,
                ),
                trace_parent(item.params.traceparent),
            )
        inc.waiting_since_ns = now_ns()
        if item.kind is ReceiveKind.PUSH:
            emit_span(
                "blocks.announce",
                item.params.traceparent,
                started_ns,
                inc.waiting_since_ns,
                {"kvpush.transfer_id": tid, "kvpush.blocks": len(item.block_ids)},
            )
        self._apply_early(tid, inc)

    def _writers(self, addresses: list[str]) -> dict[str, int]:
        """The side channels of the P ranks that hold our heads, by rank (from P's heartbeat:
        one address per rank; none known: empty)."""
        if not addresses:
            return {}
        ranks = peer_ranks(self.rank.index, self.rank.size, len(addresses))
        return {addresses[r]: r for r in ranks if r < len(addresses)}

    def _tell_prefill(self, item: DecodeWork, reason: str) -> None:
        self.bus.publish(
            subjects.abort(item.params.prefill_id),
            Abort(
                transfer_id=item.params.transfer_id,
                sender=self.settings.worker_id,
                reason=reason,
                rank=self.rank.index,
                tp=self.rank.size,
            ),
            trace_parent(item.params.traceparent),
        )

    def _abort(self, inc: Incoming, reason: str) -> None:
        if inc.state in (IncomingState.ABORTING, IncomingState.SETTLED):
            return
        inc.abort_sent_at = time.monotonic()
        self.runtime.wake_at(inc.abort_sent_at + self.settings.abort_ack_timeout_s)
        if inc.state is IncomingState.RECEIVING:
            inc.advance(IncomingState.ABORTING)
            if inc.work.kind is ReceiveKind.PULL:
                for leg in inc.legs.by_rank.values():
                    if leg.event is None:
                        self.transport.abort(leg.transport_id, reason)
                self._maybe_settle_pull(inc)
            else:
                self.transport.abort(inc.work.params.transfer_id, reason)
            self._tell_prefill(inc.work, reason)
        else:  # pull not started: no READ will be posted; P drops its blocks on the abort
            self._tell_prefill(inc.work, reason)
            self._settle(inc, TransferState.ABORTED)

    def _settle(
        self, inc: Incoming, state: TransferState, event: TransferEvent | None = None
    ) -> None:
        if inc.settled:
            return
        inc.advance(IncomingState.SETTLED, state)
        params = inc.work.params
        landed_ns = event.ended_ns if event is not None and event.ended_ns else now_ns()
        pull = inc.work.kind is ReceiveKind.PULL
        if not inc.failed:
            self.runtime.marks.record(
                params.transfer_id,
                decode_received=params.received_ns,
                kv_landed=landed_ns,
                kv_sent=landed_ns if pull else 0,  # pull: our READ done is the transfer's end
            )
        if not tracing_on():
            return
        attrs = {"kvpush.transfer_id": params.transfer_id, "kvpush.mode": params.mode.value}
        attrs, error, marks = integrity_attrs(inc, state, attrs)  # and the fallback's error
        if pull and event is not None and event.started_ns:
            emit_span(
                "kv.pull",
                params.traceparent,
                event.started_ns,
                event.ended_ns,
                {**attrs, "kvpush.bytes": event.bytes, "kvpush.descriptors": event.descriptors},
                error=error,
            )
        since_ns = inc.waiting_since_ns
        emit_span("decode.wait_kv", params.traceparent, since_ns, landed_ns, attrs, marks, error)

    def _maybe_settle_pull(self, inc: Incoming) -> None:
        """Pull: settle once every READ is quiet, and either all of them ran or we aborted."""
        legs = inc.legs
        if inc.settled or not legs.quiet or not legs.by_rank:
            return
        if legs.complete:
            self._landed(inc, legs.outcome(), legs.summary())
        elif inc.state is IncomingState.ABORTING:  # the legs still to come never will
            self._settle(inc, TransferState.ABORTED, legs.summary())

    def collect(self, events: list[TransferEvent]) -> tuple[set[str], dict[str, list[int]]]:
        """(received request ids, failed request ids -> the blocks they were to receive into),
        each request reported once, in one of the two."""
        finished: set[str] = set()
        failed: dict[str, list[int]] = {}
        with self.lock:
            self._probe_suspects()
            for event in events:
                if event.stale:  # a notice of another allocation of our blocks: dropped
                    self._stale(event.transfer_id, event.stale)
                    continue
                inc, p_rank = self._event_of(event)
                if inc is None:
                    continue
                leg = inc.legs.by_rank.get(p_rank)
                if event.quiesced and leg is not None:
                    leg.event = event
                    siblings = not (inc.legs.complete and inc.legs.quiet)  # in flight or to come
                    if event.state is not TransferState.DONE and siblings:
                        self._abort(inc, f"a read of prefill rank {p_rank} ended {event.state}")
                    self._maybe_settle_pull(inc)
                elif event.quiesced:
                    self._landed(inc, event.state, event)
                elif event.state in (TransferState.EXPIRED, TransferState.FAILED):
                    self._abort(inc, f"decode gave up: {event.state.value}")
            now = time.monotonic()
            for tid, inc in list(self._by_tid.items()):
                late = now > inc.deadline
                if late and inc.state is IncomingState.WAITING:
                    self._abort(inc, "no KvReady from prefill in time")
                elif late and inc.legs.by_rank and not inc.legs.complete:
                    self._abort(inc, "no KvReady from every prefill rank in time")
                # P silent after our abort: probe it. A peer we cannot name keeps the blocks
                # (correctness rule 3) until its heartbeat lease ends and ``peer_lost`` names it.
                if (
                    inc.state is IncomingState.ABORTING
                    and inc.peers
                    and inc.abort_sent_at is not None
                    and not inc.probing
                    and now - inc.abort_sent_at > self.settings.abort_ack_timeout_s
                ):
                    self._probe_later(inc)
                if not inc.settled or self._awaits_first_token(inc, now):
                    continue
                req_id = inc.work.req_id
                if inc.failed and not inc.request_ended:
                    failed[req_id] = list(inc.work.block_ids)
                else:
                    finished.add(req_id)
                token = inc.prefill_token
                if token is not None and not inc.failed and not inc.request_ended:
                    self._first_tokens[req_id] = PrefillToken(
                        token.token_id,
                        token.finish_reason.value if token.finish_reason else None,
                        token.stop_reason,
                    )
                self._forget(tid)
        return finished, failed

    def _awaits_first_token(self, inc: Incoming, now: float) -> bool:
        """A receive whose KV landed waits for P's first token (at most ``first_token_wait_s``:
        then the engine samples it itself, as for a request that never asked)."""
        if not inc.wants_prefill_token:
            return False
        if inc.token_due is None:
            inc.token_due = now + self.settings.first_token_wait_s
            self.runtime.wake_at(inc.token_due)
        if now < inc.token_due:
            return True
        tid, wait_s = inc.work.params.transfer_id, self.settings.first_token_wait_s
        log.warning("transfer %s: no first token from prefill in %.1f s: D samples it", tid, wait_s)
        return False

    def take_first_tokens(self) -> dict[str, PrefillToken]:
        """The first tokens of the receives reported finished since the last call, by request."""
        with self.lock:
            tokens, self._first_tokens = self._first_tokens, {}
        return tokens
