"""Decode: verify the KV that landed before vLLM may run its request (``VerifyMixin``).

When a receive's transfer ended DONE and quiesced (push: every sender rank's done notice; pull:
every READ done), ``_landed`` reads the per-block sums of what is now in the receive's blocks
(``integrity.KvSums``: computed on the KV's device, one host read) and compares the checksum of
each part with what P sent for it:

- push: each P rank's done notice carries the checksum of what it wrote, the whole of each
  block at an equal TP, slice ``Slice(rank % senders, senders)`` where several P ranks write
  into one D rank (P's TP is larger); a P of smaller TP runs one push per D rank, each with its
  own notice;
- pull: each P rank's KvReady carries one checksum per equal byte part of its blocks, over every
  block it announced; our READ of its slice sums the parts that slice covers.

All equal: VERIFIED, the receive is reported finished. One differs: MISMATCH, the receive is
reported failed, so vLLM computes the prompt itself into those blocks and never takes what
landed as valid KV (not cached, not used). A part with nothing to compare (an older or opted-out
P, a pull of a prompt whose prefix D held, a slice not on P's part bounds) is UNCHECKED: taken,
but counted and traced as such, never as verified. Each outcome is counted
(``IntegrityCounts``, up with the step's output) and put on the ``decode.wait_kv`` span.

Words of another allocation of the receive's blocks (a stale P's notice, AbortAck or KvFailed,
whose ``alloc_epoch`` is not the one announced) are dropped and counted as ``stale``.

Threading model: called by ``DecodeSide`` on its threads, under its lock.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpush.connector.integrity import (
    IntegrityCounts,
    KvSums,
    Outcome,
    checksum,
    from_parts,
    worst,
)
from kvpush.connector.layout import WHOLE, Slice
from kvpush.connector.params import ReceiveKind
from kvpush.connector.tracing import now_ns
from kvpush.connector.transfer import TransferEvent, TransferState
from kvpush.connector.vllm.incoming import Incoming

log = logging.getLogger(__name__)


class VerifyMixin:
    kv_sums: KvSums | None
    integrity: IntegrityCounts
    _by_tid: dict[str, Incoming]

    def _settle(
        self, inc: Incoming, state: TransferState, event: TransferEvent | None = None
    ) -> None:
        raise NotImplementedError

    def _landed(self, inc: Incoming, state: TransferState, event: TransferEvent | None) -> None:
        """``inc``'s transfer is over and quiesced: settle it, DONE only with its KV verified
        (or unchecked, or the checksum off); a mismatch settles it FAILED (D recomputes)."""
        if state is not TransferState.DONE or inc.request_ended:
            self._settle(inc, state, event)
            return
        outcome = Outcome.OFF if self.kv_sums is None else self._verify(inc, event)
        inc.integrity = outcome
        self.integrity.record(inc.work.req_id, outcome)
        if outcome is Outcome.MISMATCH:
            log.warning(
                "transfer %s: KV checksum mismatch (%s): decode computes the prompt itself",
                inc.work.params.transfer_id,
                inc.integrity_detail,
            )
            state = TransferState.FAILED
        self._settle(inc, state, event)

    def _verify(self, inc: Incoming, event: TransferEvent | None) -> Outcome:
        expected = self._expected(inc, event)
        if self.kv_sums is None or all(value is None for value, _ in expected):
            return Outcome.UNCHECKED
        sums = self.kv_sums.all_layers(inc.work.block_ids)
        result = Outcome.VERIFIED if expected else Outcome.UNCHECKED
        for value, part in expected:
            got = None if value is None else checksum(sums, 0, part)
            if got is None:
                result = worst(result, Outcome.UNCHECKED)
            elif got != value:
                inc.integrity_detail = f"slice {part.index}/{part.parts}: {got} != sent {value}"
                return Outcome.MISMATCH
        return result

    def _expected(
        self, inc: Incoming, event: TransferEvent | None
    ) -> list[tuple[int | None, Slice]]:
        """(P's checksum or None, the slice of our blocks it covers), one per part."""
        if inc.work.kind is ReceiveKind.PULL:
            expected: list[tuple[int | None, Slice]] = []
            for p_rank, leg in sorted(inc.legs.by_rank.items()):
                sent = inc.ready_sums.get(p_rank)
                ours, theirs = leg.spec.parts
                # P's checksums cover every block it announced; a prefix we held was not read
                whole = sent is not None and not inc.work.first_token
                expected.append((from_parts(sent, theirs) if whole else None, ours))  # type: ignore[arg-type]
            return expected
        sums = event.checksums if event is not None else {}
        senders = len(sums)
        return [
            (value, WHOLE if senders == 1 else Slice(rank % senders, senders))
            for rank, value in sorted(sums.items())
        ]

    def _other_allocation(self, inc: Incoming, message: Any) -> bool:
        """Does ``message`` (AbortAck, KvFailed) echo another allocation of our blocks? Then it
        is a stale sender's word: dropped and counted."""
        ours, theirs = inc.work.alloc_epoch, getattr(message, "alloc_epoch", 0)
        if not (ours and theirs and ours != theirs):
            return False
        self._stale(inc.work.params.transfer_id, f"{type(message).__name__} of allocation {theirs}")
        return True

    def _stale(self, transfer_id: str, what: str) -> None:
        """Count (and note on the receive, for its span) a dropped word of a stale sender."""
        log.warning("transfer %s: dropped a stale sender's %s", transfer_id, what)
        self.integrity.stale()
        inc = self._by_tid.get(transfer_id)
        if inc is not None:
            inc.stale += 1


def integrity_attrs(
    inc: Incoming, state: TransferState, attrs: dict[str, str | int]
) -> tuple[dict[str, str | int], str | None, list[tuple[str, int, dict[str, str]]]]:
    """The ``decode.wait_kv`` span's attributes with the receive's integrity outcome and stale
    words, its error when D fell back (why) and its events (a mismatch, with what differed)."""
    attrs = dict(attrs)
    if inc.integrity is not None:
        attrs["kvpush.kv_integrity"] = inc.integrity.value
    if inc.stale:
        attrs["kvpush.kv_stale_dropped"] = inc.stale
    mismatch = inc.integrity is Outcome.MISMATCH
    why = "KV checksum mismatch" if mismatch else state.value
    error = f"{why}: fell back to local prefill" if inc.failed else None
    detail = {"kvpush.detail": inc.integrity_detail[:300]}
    return attrs, error, [("kv.integrity.mismatch", now_ns(), detail)] if mismatch else []
