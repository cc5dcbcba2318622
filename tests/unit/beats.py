"""Heartbeats and a settable clock for the unit tests of membership, routing and migration,
and a reference for the router's device shares."""

from __future__ import annotations

from collections.abc import Sequence

from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.gateway.cost_model import CostModel
from kvpush.services.gateway.worker_registry import WorkerState


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


def others_on_device(
    model: CostModel,
    prefills: Sequence[WorkerState],
    decodes: Sequence[WorkerState],
    state: WorkerState,
) -> float:
    """The queued compute (ms) of the other engines on ``state``'s device, summed one by one (a
    P's load, a D's waiting prefills, each x its service time): what ``device_share`` gives."""

    def queued(worker: WorkerState) -> float:
        waiting = worker.load if worker in prefills else max(0, worker.load - worker.running)
        return waiting * model.view(worker.worker_id).service_ms

    if not state.gpu:
        return 0.0
    everyone = [*prefills, *decodes]
    return sum(queued(w) for w in everyone if w is not state and w.gpu == state.gpu)
