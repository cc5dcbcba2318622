"""``EngineLink``: what the driver of an in-process vLLM engine learns from its kvpush connector.

vLLM builds the connector's two halves itself; the driver (the worker service's ``EngineHost``)
reaches them through the engine, never through a module global: the scheduler half is the
``EngineCore``'s ``scheduler.connector``, the worker half is vLLM's ``get_kv_transfer_group()``
of this process (uniproc executor: the worker runs in the caller's process). From them the link
gives the wake-up signal (``activity``), the pending count, the last step's idleness, the side
channel to announce (``info``), the suspect-peer input and the timing marks of a transfer.

An engine without a kvpush connector gets a link of its own event and no work: the driver's loop
is the same with or without one.

Threading model: everything here is safe from any thread (``WorkerRuntime`` locks; the
scheduler half's flag is read on the engine thread, where it is written). ``attach`` runs on the
engine thread after the engine is built; it imports vLLM there, so this module itself does not.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpush.connector.vllm.runtime import ConnectorInfo, WorkerRuntime
from kvpush.schemas.messages import Timing


class EngineLink:
    """One engine's connector as its in-process driver sees it (see the module docstring)."""

    def __init__(self, runtime: WorkerRuntime | None = None, scheduler: Any = None) -> None:
        self._runtime = runtime
        self._scheduler = scheduler
        self.activity: threading.Event = runtime.activity if runtime else threading.Event()

    @classmethod
    def attach(cls, engine_core: Any) -> EngineLink:
        """The link of vLLM's in-process ``EngineCore`` (``InprocClient.engine_core``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        scheduler = getattr(engine_core.scheduler, "connector", None)
        worker = get_kv_transfer_group() if has_kv_transfer_group() else None
        runtime = getattr(worker, "runtime", None)
        if scheduler is None or not isinstance(runtime, WorkerRuntime):
            return cls()  # no kvpush connector in this engine
        return cls(runtime, scheduler)

    @property
    def connected(self) -> bool:
        return self._runtime is not None

    @property
    def info(self) -> ConnectorInfo | None:
        """The worker half's identity once its KV cache is registered."""
        return self._runtime.info if self._runtime is not None else None

    def pending(self) -> int:
        """Transfers the connector still has to report through an engine step."""
        return self._runtime.pending() if self._runtime is not None else 0

    def last_step_idle(self) -> bool:
        return bool(self._scheduler is not None and self._scheduler.last_step_idle)

    def suspect_peer(self, address: str) -> None:
        """Tell the decode side that the peer at ``address`` may be gone (it probes it)."""
        if self._runtime is not None:
            self._runtime.suspect_peer(address)

    def take_timing(self, transfer_id: str) -> Timing | None:
        """The critical-path instants the connector learned of a transfer (and forget them)."""
        return self._runtime.marks.take(transfer_id) if self._runtime is not None else None
