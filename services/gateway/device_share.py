"""Engines that share one device: the queued compute of the others, per worker.

Workers name the device their engine computes on in their heartbeats (``gpu``: a GPU,
``<host>/gpu<index>``, or the cores a CPU engine is pinned to, ``<host>/cpu<cores>``; "": none
known). Engines on one device take turns on its compute: a prefill queued on one delays every
other's. ``CostModel.device_sums`` adds up each device's queued compute (each P's load and each
D's waiting LOCAL prefills, times its service time) in one pass a role; ``others`` is what a
worker's estimate adds of it, ``device(W)`` of ``cost_model``: the sum less the worker's own
(the parts, ``CostModel.prefill_parts`` and ``decode_parts``, compute the same inline).

Threading model: pure functions of their arguments, on the gateway's loop.
"""

from __future__ import annotations

from collections.abc import Mapping


def others(sums: Mapping[str, float] | None, device: str, own: float) -> float:
    """The queued compute (ms) of the other engines on ``device`` ("": none, 0), given its
    engines' sums (``CostModel.device_sums``; None: no device named) and this one's ``own``:
    never below 0 (every addend of a sum is not, and rounding is monotone)."""
    return sums.get(device, 0.0) - own if device and sums else 0.0
