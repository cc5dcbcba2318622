"""``Poller``: drives a ``KvTransport`` from its own thread (there is no NIXL progress thread).

It calls ``transport.poll()`` and sleeps as long as ``transport.poll_interval`` allows: busy
(``busy_interval_s``) while NIXL requests are live, a handshake is pending or a done notice waits
for P's late checksum (``transfer.LateChecksum``), ``target_interval_s``
while a completion notice is expected, ``idle_interval_s`` otherwise, so a push waiting for its
next layer does not steal the engine's core. The transport wakes it on every post, expect, abort
or acknowledgement (``transport.on_change``). Events go to a bounded queue; when it is full the
poller stops polling until the owner drains it (nothing is dropped); ``on_events`` is called on
the poller thread after new events were queued.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

from kvpush.connector.transfer import TransferEvent
from kvpush.connector.transport import KvTransport


def worker_intervals(decode: bool, gpu: bool = False) -> dict[str, float]:
    """The intervals of a kvpush worker's Poller (``kvpush bench transport`` measures with them).

    Idle polls (nothing live, no notice imminent) every 50 ms: a decode engine waiting for a
    prefill costs almost nothing. P polls its live WRITEs every ``target`` (1 ms) while the
    prefill computes and every ``busy`` (0.5 ms) once the last layer is posted. D polls every
    ``target`` once KvPushing said the notice is imminent: on a GPU host 0.2 ms, since that wait
    is on the request's critical path and an idle poll costs ~2.5 us (on the H200 the 1 ms of
    before put ~0.6 ms more between P's DONE and D seeing it, gpu.md); on CPU 1 ms, as measured
    on the 2-core box, where D's polls compete with its engine for the cores."""
    target = 0.0002 if decode and gpu else 0.001
    return {"busy_interval_s": 0.0005, "target_interval_s": target, "idle_interval_s": 0.05}


class Poller:
    """Calls ``transport.poll()`` from its own thread; events land in a bounded queue."""

    def __init__(
        self,
        transport: KvTransport,
        busy_interval_s: float = 0.0002,
        idle_interval_s: float = 0.02,
        target_interval_s: float = 0.001,
        max_events: int = 4096,
        on_events: Callable[[], None] | None = None,
    ) -> None:
        self.transport = transport
        self.on_events = on_events  # called on the poller thread after events were queued
        transport.on_change = self.wake
        self.intervals = (busy_interval_s, target_interval_s, idle_interval_s)
        self.events: queue.Queue[TransferEvent] = queue.Queue(maxsize=max_events)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpush-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            events = self.transport.poll()
            for event in events:
                while not self._stop.is_set():  # full queue: wait for the owner, drop nothing
                    with contextlib.suppress(queue.Full):
                        self.events.put(event, timeout=0.1)
                        break
            if events and self.on_events is not None:
                self.on_events()
            self._wake.wait(self.transport.poll_interval(*self.intervals))
            self._wake.clear()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2.0)
