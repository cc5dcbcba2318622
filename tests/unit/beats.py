"""Heartbeats and a settable clock for the unit tests of membership, routing and migration."""

from __future__ import annotations

from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(role: WorkerRole, worker: str, **fields: object) -> WorkerHeartbeat:
    values: dict[str, object] = {
        "worker_id": worker,
        "role": role,
        "epoch": 1,
        "model": "m",
        "side_channel": "tcp://127.0.0.1:5555",
        "in_flight": 0,
        "queue_depth": 0,
        "free_blocks": 100,
        "total_blocks": 100,
        "sent_at_ms": 0,
        **fields,
    }
    return WorkerHeartbeat(**values)  # type: ignore[arg-type]
