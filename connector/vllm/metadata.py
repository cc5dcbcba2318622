"""Scheduler -> worker metadata of the vLLM adapter: ``KVPushMetadata``, one per engine step.

It subclasses vLLM's ``KVConnectorMetadata`` and holds only values of ``kvpush.connector.params``
(msgspec structs and lists), since it is pickled when the worker runs in another process.

Threading model: none (values).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpush.connector.params import DecodeWork, PrefillWork


class KVPushMetadata(KVConnectorMetadata):
    def __init__(self) -> None:
        self.prefill: list[PrefillWork] = []
        self.decode: list[DecodeWork] = []
        self.idle_step = False
