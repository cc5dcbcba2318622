"""``InFlight``: one request a worker accepted, and the ``kv_transfer_params`` it gives the
connector (transfer id, peers, deadline, trace context, when it arrived).

Threading model: an ``InFlight`` lives on the worker's asyncio loop (worker.py) and is touched
there only; ``kv_params`` reads the current trace context, so call it in the request's task.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from opentelemetry import propagate

from kvpush.connector import TransferParams, samples_on_prefill
from kvpush.schemas.messages import RequestEvent, TransferMode, WorkerRole
from kvpush.services.workers.handles import RequestHandle


@dataclasses.dataclass
class InFlight:
    """One request this worker accepted; ``handle`` is set once it went to the engine."""

    event: RequestEvent
    received_ns: int = 0  # unix ns the RequestEvent arrived
    handle: RequestHandle | None = None
    task: asyncio.Task[None] | None = None
    aborted: str | None = None  # why it was aborted ("deadline", or the Abort's reason)
    timer: asyncio.TimerHandle | None = None

    def queued_for_prefill(self, role: WorkerRole) -> bool:
        """Waits for this worker's own prefill (a heartbeat's ``queue_depth``): not past its
        first output and, on D, computed there (LOCAL). A push/pull request on D waits for
        P's KV, not for D's engine: once it lands it costs D a step, not a prefill."""
        if self.handle is not None and self.handle.first_output_at is not None:
            return False
        return role is not WorkerRole.DECODE or self.event.mode is TransferMode.LOCAL

    def kv_params(self, prefill_addresses: list[str] | None = None) -> dict[str, Any]:
        """The connector's ``kv_transfer_params`` for this request (trace context included)."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        event = self.event
        return TransferParams(
            transfer_id=event.transfer_id,
            prefill_id=event.prefill_id,
            decode_id=event.decode_id,
            mode=event.mode,
            deadline_ms=event.deadline_ms,
            traceparent=carrier.get("traceparent"),
            prefill_address=prefill_addresses[0] if prefill_addresses else None,
            prefill_addresses=list(prefill_addresses or []),
            received_ns=self.received_ns,
            first_token_from_prefill=event.first_token_by is WorkerRole.PREFILL
            and samples_on_prefill(event.sampling),  # (D's engine sees one answer's params)
        ).to_params()
