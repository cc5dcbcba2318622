"""What the vLLM adapter's halves send each other through vLLM, and nothing else.

- ``KVPushMetadata``: scheduler half -> every worker half (every TP rank gets the same object),
  once per engine step: this step's prefill and decode work, the suspect peers the driver named,
  whether the step schedules no tokens.
- ``KVPushWorkerMeta``: one worker half -> the scheduler half, with a step's output: the timing
  marks that rank learned, the first tokens P sampled for the receives it reports finished
  in that step, and the KV integrity outcomes of those receives (with the counts since the
  last step: ``integrity.IntegrityCounts``). vLLM merges the ranks' objects with ``aggregate``.
- ``KVPushHandshake``: one worker half -> the scheduler half, once after KV registration
  (``get_handshake_metadata``): that rank's ``ConnectorInfo``.

All three hold only msgspec values, since vLLM pickles them when a worker runs in another
process.

Threading model: none (values).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpush.connector.integrity import Outcome, worst
from kvpush.connector.params import DecodeWork, PrefillToken, PrefillWork
from kvpush.connector.vllm.runtime import ConnectorInfo
from kvpush.schemas.messages import Timing


class KVPushMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        self.prefill: list[PrefillWork] = []
        self.decode: list[DecodeWork] = []
        self.suspects: list[str] = []
        self.idle_step = False


class KVPushWorkerMeta(KVConnectorWorkerMetadata):
    def __init__(
        self,
        marks: dict[str, list[Timing]],
        first_tokens: dict[str, PrefillToken],
        counts: dict[str, int] | None = None,
        outcomes: dict[str, str] | None = None,
    ) -> None:
        self.marks = marks  # transfer id -> the instants each rank learned
        self.first_tokens = first_tokens  # request id -> the first token P sampled
        self.counts = counts or {}  # integrity outcome (or "stale") -> how many, this step
        self.outcomes = outcomes or {}  # request id -> its receive's integrity outcome

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPushWorkerMeta:
        if isinstance(other, KVPushWorkerMeta):
            for tid, timings in other.marks.items():
                self.marks.setdefault(tid, []).extend(timings)
            self.first_tokens.update(other.first_tokens)  # every rank got the same token
            for name, count in other.counts.items():
                self.counts[name] = self.counts.get(name, 0) + count
            merge_outcomes(self.outcomes, other.outcomes)
        return self


def merge_outcomes(into: dict[str, str], more: dict[str, str]) -> None:
    """Add ``more``'s outcomes to ``into``'s; a request of several ranks keeps the worst."""
    for req_id, outcome in more.items():
        known = into.get(req_id)
        into[req_id] = outcome if known is None else worst(Outcome(known), Outcome(outcome)).value


class KVPushHandshake(KVConnectorHandshakeMetadata):
    def __init__(self, info: ConnectorInfo) -> None:
        self.info = info
