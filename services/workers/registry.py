"""The worker registry: a JetStream KV bucket where every worker keeps its last heartbeat.

Bucket ``BUCKET`` (``kvpush-workers``), key ``<role>.<worker_id>``, value: the worker's last
``WorkerHeartbeat`` in its wire form (``kvpush.schemas.codec``). Each worker ``put``s on every
heartbeat and ``delete``s its key when it stops; the bucket's TTL (``ttl_s``, set by whoever
creates the bucket first) drops the entry of a worker that died without deregistering. Anyone
can list the live workers without waiting for a heartbeat (``Registry.entries``).

Without JetStream (an external nats-server started without ``-js``) ``Registry.open`` returns
None and workers are announced by heartbeats alone.

Threading model: asyncio, on the loop of the ``Bus`` it was opened with.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvpush.connector import Bus
from kvpush.schemas import codec, subjects
from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole

log = logging.getLogger(__name__)

BUCKET = "kvpush-workers"


def key(role: WorkerRole, worker_id: str) -> str:
    return f"{WorkerRole(role).value}.{subjects.check_id(worker_id)}"


class Registry:
    """One handle on the bucket."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv  # nats.js.kv.KeyValue

    @classmethod
    async def open(cls, bus: Bus, ttl_s: float, replicas: int = 1) -> Registry | None:
        """The bucket (created with ``ttl_s`` and ``replicas`` if missing: 3 on a 3-server
        NATS cluster), or None without JetStream."""
        js = bus.client.jetstream()
        try:
            return cls(
                await js.create_key_value(bucket=BUCKET, ttl=ttl_s, replicas=max(1, replicas))
            )
        except Exception as exc:
            try:  # it exists with another TTL: use it as it is
                return cls(await js.key_value(BUCKET))
            except Exception:
                log.warning("no worker registry (JetStream unavailable?): %r", exc)
                return None

    async def put(self, beat: WorkerHeartbeat) -> None:
        await self._kv.put(key(beat.role, beat.worker_id), codec.encode(beat))

    async def delete(self, role: WorkerRole, worker_id: str) -> None:
        await self._kv.delete(key(role, worker_id))

    async def entries(self, role: WorkerRole | None = None) -> list[WorkerHeartbeat]:
        """The live entries (of ``role``, or all)."""
        try:
            keys = await self._kv.keys()
        except Exception:  # nats raises NoKeysError on an empty bucket
            return []
        beats = []
        for name in keys:
            kind, _, worker = name.partition(".")
            if role is not None and kind != role.value:
                continue
            with contextlib.suppress(Exception):  # expired or deleted meanwhile, or not ours
                entry = await self._kv.get(name)
                beat = codec.decode(subjects.heartbeat(WorkerRole(kind), worker), entry.value)
                if isinstance(beat, WorkerHeartbeat):
                    beats.append(beat)
        return beats
