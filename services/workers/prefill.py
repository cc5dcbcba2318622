"""Prefill worker (``kvpush prefill``): computes prompts and lets the connector push their KV.

Owns what a request means on the prefill side: for every RequestEvent on
``kvpush.v1.req.<me>.*`` in mode push or pull it submits the prompt with ``max_tokens=1`` and
the event's transfer parameters to its engine; the kvpush connector inside the engine does the
rest (match D's BlocksAnnounced, WRITE layer by layer, KvPushed / KvFailed). With
``first_token_by`` prefill (where P's token is one engine's: ``samples_on_prefill``) it
samples that one token with the request's own sampling and sends it to D (``FirstToken`` on
``kvpush.v1.kv.done.<D>``), which continues the answer from it (``first_token.py``); otherwise
it samples greedily and the token goes nowhere. Mode local is not its business (D computes the
prompt) and is ignored, and so is a request for the prompt's log-probabilities (they need D's
own prefill: D refuses one in push and pull). A request it cannot take (over
``--max-inflight``, past its deadline, another model, rejected by the engine before the
connector saw it) is answered with KvFailed to the decode worker, which then computes the
prompt itself at once instead of waiting for KV (docs/design.md, correctness rule 5). A decode
worker that leaves this worker's view of decode workers (``peers``: silent past its lease,
restarted) gets every request still pushing into it aborted at once, which frees
their source blocks.

Threading model: ``Worker``'s (asyncio on the main thread, the engine on its own thread).
"""

from __future__ import annotations

import argparse
import logging

from kvpush.connector import samples_on_prefill
from kvpush.schemas import subjects
from kvpush.schemas.messages import FailReason, KvFailed, RequestEvent, TransferMode, WorkerRole
from kvpush.schemas.sampling import SamplingSpec
from kvpush.services.membership import Member
from kvpush.services.workers.config import WorkerConfig
from kvpush.services.workers.first_token import first_token_of, prefill_sampling
from kvpush.services.workers.inflight import InFlight
from kvpush.services.workers.worker import Worker, run_worker

log = logging.getLogger(__name__)

PREFILL_SAMPLING = SamplingSpec(max_tokens=1, temperature=0.0)  # n 1, no logprobs, no grammar
REJECTED = "rejected:"  # EngineHost's error prefix for a request the engine never took


class PrefillWorker(Worker):
    role = WorkerRole.PREFILL

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.peers.on_leave(self._decode_left)

    def _decode_left(self, member: Member) -> None:
        """A decode worker is gone: what this worker computes or pushes for it is abandoned."""
        gone = member.heartbeat.worker_id
        for entry in list(self._inflight.values()):
            if entry.event.decode_id == gone:
                self._abort(
                    entry,
                    f"decode worker {gone} left ({member.why})",
                )

    def request_filter(self) -> str:
        return subjects.requests_for_prefill(self.worker_id)

    def accepts(self, event: RequestEvent) -> bool:
        return event.mode is not TransferMode.LOCAL and event.sampling.prompt_logprobs is None

    async def serve(self, entry: InFlight) -> None:
        event = entry.event
        rid, tid = event.request_id, event.transfer_id
        # the gateway's rule, checked again: D takes no token where P's is not one engine's
        samples_first = event.first_token_by is WorkerRole.PREFILL and samples_on_prefill(
            event.sampling
        )
        sampling = prefill_sampling(event.sampling) if samples_first else PREFILL_SAMPLING
        handle = self.submit(entry, sampling, entry.kv_params())
        if handle is None:  # the connector never saw it: nothing is in flight, tell D
            await self.refuse(event, FailReason.PREFILL, f"aborted before prefill: {entry.aborted}")
            return
        log.info(
            "prefill rid=%s tid=%s: %d tokens, mode %s, decode %s",
            rid,
            tid,
            len(event.prompt_token_ids),
            event.mode.value,
            event.decode_id,
        )
        final = None
        async for final in handle:  # noqa: B007  (only the last output matters)
            pass
        sent = self.host.sends_first_tokens  # process mode: P's engine core sent it to D
        if samples_first and not sent and final is not None and final.token_ids and not final.error:
            # the token this prefill sampled, to D, which continues the answer from it
            token = first_token_of(tid, self.worker_id, event.decode_id, final)
            await self.bus.publish(subjects.kv_done(event.decode_id), token, span=False)
        if final is not None and final.error and final.error.startswith(REJECTED):
            # The connector never saw this request, so nothing of it is in flight: tell D.
            await self.refuse(event, FailReason.PREFILL, final.error)
        elif final is not None and final.error:
            log.warning("prefill rid=%s tid=%s failed: %s", rid, tid, final.error)
        else:
            took = (handle.finished_at or 0.0) - handle.submitted_at
            log.info("prefilled rid=%s tid=%s in %.3f s", rid, tid, took)

    async def refuse(self, event: RequestEvent, reason: FailReason, detail: str = "") -> None:
        log.warning(
            "refusing rid=%s tid=%s: %s %s",
            event.request_id,
            event.transfer_id,
            reason.value,
            detail,
        )
        failed = KvFailed(
            transfer_id=event.transfer_id,
            prefill_id=self.worker_id,
            decode_id=event.decode_id,
            reason=reason,
            detail=detail[:1000],
        )
        await self.bus.publish(subjects.kv_failed(event.decode_id), failed)


def main(args: argparse.Namespace) -> int:
    """``kvpush prefill``."""
    return run_worker(PrefillWorker, args)
