"""``EngineLink``: what the driver of an in-process vLLM engine core learns from its connector.

vLLM builds the connector's halves itself; the driver (the worker service's ``EngineHost``)
reaches the scheduler half through the engine, never through a module global: it is the
``EngineCore``'s ``scheduler.connector``. That works whatever executor runs the worker halves
(uniproc: in this process; multiprocess, e.g. TP > 1: one process per rank), since everything
the scheduler half knows came through vLLM or its wake-up line (``connector/vllm/scheduler.py``).
The link gives the wake-up signal (``activity``), the pending count, the last step's idleness,
every rank's identity (``ranks``, ``info`` for rank 0), the suspect-peer input, and the KV
integrity counts (``integrity_counts``: receives verified, mismatched and recomputed, unchecked,
stale words dropped). The timing
marks of a transfer come on the request's final output (``kvpush.connector.timing_of``), and
those that came up in its last step from ``take_timing``. A driver that attaches a link also
takes on reporting the first tokens P sampled (``take_prefill_tokens``, after every step):
without one, the connector lets decode sample them itself.

An engine without a kvpush connector gets a link of its own event and no work: the driver's loop
is the same with or without one.

Threading model: ``activity`` is an Event (any thread); ``suspect_peer`` is safe from any
thread; the rest is read on the engine thread, where vLLM writes it. ``attach`` runs on the
engine thread after the engine is built.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpush.connector.params import PrefillToken
from kvpush.connector.vllm.runtime import ConnectorInfo
from kvpush.schemas.messages import Timing


class EngineLink:
    """One engine's connector as its in-process driver sees it (see the module docstring)."""

    def __init__(self, scheduler_half: Any = None) -> None:
        self._half = scheduler_half
        self.activity: threading.Event = (
            scheduler_half.activity if scheduler_half is not None else threading.Event()
        )

    @classmethod
    def attach(cls, engine_core: Any) -> EngineLink:
        """The link of vLLM's in-process ``EngineCore`` (``InprocClient.engine_core``)."""
        connector = getattr(engine_core.scheduler, "connector", None)
        half = getattr(connector, "scheduler_half", None)
        if half is None:  # another vendor's connector
            return cls()
        half.driver_takes_tokens = True  # this driver reports P's first tokens
        half.free_blocks = engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks
        return cls(half)

    @property
    def connected(self) -> bool:
        return self._half is not None

    @property
    def ranks(self) -> list[ConnectorInfo]:
        """Every TP rank's identity (registered KV cache, side channel), by rank."""
        if self._half is None:
            return []
        return [self._half.ranks[rank] for rank in sorted(self._half.ranks)]

    @property
    def info(self) -> ConnectorInfo | None:
        """Rank 0's identity once its KV cache is registered."""
        ranks = self.ranks
        return ranks[0] if ranks else None

    def pending(self) -> int:
        """Transfers the connector still has to report through an engine step."""
        return self._half.pending() if self._half is not None else 0

    def last_step_idle(self) -> bool:
        return bool(self._half is not None and self._half.last_step_idle)

    def integrity_counts(self) -> dict[str, int]:
        """Decode: KV integrity outcomes so far, every rank's (``verified``, ``mismatch``: D
        recomputed the prompt, ``unchecked``, ``stale``); empty on prefill or without one."""
        return self._half.integrity_counts() if self._half is not None else {}

    def take_timing(self, transfer_id: str) -> Timing | None:
        """Marks of ``transfer_id`` the final output could not carry yet (and forget them)."""
        return self._half.take_timing(transfer_id) if self._half is not None else None

    def take_prefill_tokens(self) -> list[tuple[str, PrefillToken]]:
        """P's first tokens to report as outputs now (vLLM's request id, the token and how
        the answer ends with it), learned in the last step (and forget them). The driver that
        attached the link must report them before the next step (``EngineHost`` does)."""
        return self._half.take_prefill_tokens() if self._half is not None else []

    def suspect_peer(self, address: str) -> None:
        """Tell every rank's decode side that the peer at ``address`` may be gone."""
        if self._half is not None:
            self._half.suspect_peer(address)
