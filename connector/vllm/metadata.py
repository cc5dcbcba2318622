"""What the vLLM adapter's halves send each other through vLLM, and nothing else.

- ``KVPushMetadata``: scheduler half -> every worker half (every TP rank gets the same object),
  once per engine step: this step's prefill and decode work, the suspect peers the driver named,
  whether the step schedules no tokens.
- ``KVPushWorkerMeta``: one worker half -> the scheduler half, with a step's output: the timing
  marks that rank learned, and the first tokens P sampled for the receives it reports finished
  in that step. vLLM merges the ranks' objects with ``aggregate``.
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
        self, marks: dict[str, list[Timing]], first_tokens: dict[str, PrefillToken]
    ) -> None:
        self.marks = marks  # transfer id -> the instants each rank learned
        self.first_tokens = first_tokens  # request id -> the first token P sampled

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVPushWorkerMeta:
        if isinstance(other, KVPushWorkerMeta):
            for tid, timings in other.marks.items():
                self.marks.setdefault(tid, []).extend(timings)
            self.first_tokens.update(other.first_tokens)  # every rank got the same token
        return self


class KVPushHandshake(KVConnectorHandshakeMetadata):
    def __init__(self, info: ConnectorInfo) -> None:
        self.info = info
