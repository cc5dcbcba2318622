"""Engines that share one device: the queued compute of the others, per worker.

Workers name the device their engine computes on in their heartbeats (``gpu``: a GPU,
``<host>/gpu<index>``, or the cores a CPU engine is pinned to, ``<host>/cpu<cores>``; "": none
known). Engines on one device take turns on its compute: a prefill queued on one delays every
other's. ``device_queues`` gives, for each P and D the router reads, the queued compute (ms) of
the other engines on its device (``device(W)`` of ``cost_model``'s estimates): each one's
queued prefills (a P's load, a D's waiting LOCAL prefills) times its service time.

Threading model: pure functions of their arguments, on the gateway's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpush.services.gateway.cost_terms import WorkerView

DeviceRow = tuple[str, int, str]
"""What ``device_queues`` reads of one worker: its id, its queued prefills (a P's load; a D's
load less its running requests) and its device (heartbeats' ``gpu``; "": none)."""


def device_queues(
    view: Callable[[str], WorkerView], prefills: Sequence[DeviceRow], decodes: Sequence[DeviceRow]
) -> tuple[list[float], list[float]] | None:
    """Per P and per D (as given), the queued compute (ms) of the other engines on its device,
    by each one's ``view`` (``CostModel.view``); None where no worker names a device (each
    engine computes alone), in one pass over each side."""
    if not any(device for _, _, device in prefills) and not any(device for _, _, device in decodes):
        return None
    rows = [*prefills, *decodes]
    own = [
        queued * view(worker_id).service_ms if device and queued > 0 else 0.0
        for worker_id, queued, device in rows
    ]
    sums: dict[str, float] = {}
    for (_, _, device), mine in zip(rows, own, strict=True):
        if device:
            sums[device] = sums.get(device, 0.0) + mine
    # the others' part of a sum is never below 0: every addend is, and rounding is monotone
    others = [
        sums[device] - mine if device else 0.0
        for (_, _, device), mine in zip(rows, own, strict=True)
    ]
    return others[: len(prefills)], others[len(prefills) :]
