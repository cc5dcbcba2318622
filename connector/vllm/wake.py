"""The wake-up line from an engine's worker halves to its scheduler half, across processes.

A worker half (one per TP rank; in the engine's process with vLLM's uniproc executor, in a worker
process of its own with the multiprocess executor) learns of events only an engine step can act
on: a WRITE or READ finished, an announcement, a KvReady or an abort arrived. It calls
``WakeSender.notify``; the scheduler half's ``WakeListener`` sets its ``event``, which is what an
in-process driver (``kvpush.connector.EngineLink``) sleeps on between idle steps.

The line is a Linux abstract-namespace UNIX datagram socket named after vLLM's ``engine_id``
(the same on every rank of one engine): nothing on disk to clean up, a datagram send never
blocks, and a wake-up sent while nobody listens (before the scheduler half exists, or after it
closed) is simply lost, which is harmless: a wake-up only shortens a sleep that the driver bounds
anyway.

Threading model: ``WakeSender.notify`` is safe from any thread (one datagram, no shared state).
``WakeListener`` owns one daemon thread blocked in ``recv``; ``close`` ends it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

STOP = b"s"


def wake_address(engine_id: str) -> str:
    """The abstract socket name of one engine's wake-up line."""
    return f"\0kvpush-wake-{engine_id}"


class WakeSender:
    """A worker half's end: ``notify()`` from any thread, never blocks, never raises."""

    def __init__(self, engine_id: str) -> None:
        self.address = wake_address(engine_id)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def notify(self) -> None:
        with contextlib.suppress(OSError):  # nobody listening, or the queue is full: fine
            self._sock.sendto(b"w", self.address)

    def close(self) -> None:
        self._sock.close()


class WakeListener:
    """The scheduler half's end: each datagram sets ``event``."""

    def __init__(self, engine_id: str, event: threading.Event | None = None) -> None:
        self.address = wake_address(engine_id)
        self.event = event or threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.address)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvpush-wake", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._sock.recv(16)
            except OSError:
                return
            if data == STOP and self._closing:  # our own close(), not some other sender
                return
            self.event.set()

    def close(self) -> None:
        self._closing = True
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._sock.sendto(STOP, self.address)
            self._thread.join(2)
        self._sock.close()
