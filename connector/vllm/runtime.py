"""Per-process connector runtime: the bus thread and the wake-up signal shared by both halves.

vLLM builds the scheduler half and the worker half of a connector as two objects, in one
process (uniproc executor) or two (multiprocess executor). Each half calls ``BusThread.get`` to
reach NATS; halves in the same process share one connection. The runtime also carries the
signal an engine driver uses so that a decode engine waiting for KV costs nothing:

- ``activity`` (a ``threading.Event``) is set whenever something happened that only an engine
  step can act on: a transfer finished or failed, an announcement or a KvReady arrived, an abort.
- ``pending`` counts work the connector still has to report through an engine step (a push in
  flight on P, a receive on D). A driver that sees ``pending > 0`` and an idle step waits on
  ``activity`` instead of stepping in a loop.
- ``suspect_peer`` / ``take_suspects``: side-channel addresses the worker service believes dead
  (a prefill worker's heartbeat lease ran out); the decode side probes them.

Threading model: ``BusThread`` owns one asyncio loop on a daemon thread named
``kvpush-bus``; callers on other threads use ``publish`` (fire and forget, bounded by the
loop's queue) and ``subscribe`` (handlers run on the bus thread and must be quick and
thread-safe). ``close`` drains and stops it. The module-level registry is guarded by a lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from kvpush.schemas.codec import BusMessage
from kvpush.services.bus import Bus, BusConfig

log = logging.getLogger(__name__)

activity = threading.Event()
_pending_lock = threading.Lock()
_pending = 0
_last_step_idle = False
info: dict[str, str] = {}  # set by the worker half: worker_id, role, side_channel, compat_hash


def add_pending(delta: int) -> None:
    global _pending
    with _pending_lock:
        _pending += delta


def pending() -> int:
    return _pending


def mark_step(idle: bool) -> None:
    """Called by the scheduler half once a step: did this step schedule no tokens at all?"""
    global _last_step_idle
    _last_step_idle = idle


def last_step_idle() -> bool:
    return _last_step_idle


def notify() -> None:
    activity.set()


_suspects_lock = threading.Lock()
_suspects: set[str] = set()


def suspect_peer(address: str) -> None:
    """A peer's side channel that may be dead (its heartbeat lease ran out, or it came back with
    a new epoch): the decode side probes it and, if it does not answer, fails what is in flight
    from it at once (D computes those prompts itself) instead of at the request's deadline."""
    with _suspects_lock:
        _suspects.add(address)
    notify()


def take_suspects() -> set[str]:
    global _suspects
    with _suspects_lock:
        taken, _suspects = _suspects, set()
    return taken


SyncHandler = Callable[[str, BusMessage], None]


class BusThread:
    """One NATS connection on its own asyncio thread, shared per (process, url)."""

    _instances: dict[str, BusThread] = {}  # noqa: RUF012  (process registry)
    _lock = threading.Lock()

    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._bus: Bus | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvpush-bus", daemon=True)
        self._thread.start()
        self._ready.wait(config.initial_connect_timeout_s + 5)
        if self._error is not None:
            raise self._error
        if self._bus is None:
            raise ConnectionError(f"kvpush connector: no NATS connection to {config.url}")

    @classmethod
    def get(cls, config: BusConfig) -> BusThread:
        with cls._lock:
            existing = cls._instances.get(config.url)
            if existing is None or not existing.alive:
                existing = cls(config)
                cls._instances[config.url] = existing
            return existing

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._bus is not None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._bus = self._loop.run_until_complete(Bus.connect(self.config))
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        # Stopped by close(): end what the client left running, then close the loop quietly.
        leftover = asyncio.all_tasks(self._loop)
        for task in leftover:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        self._loop.close()

    def publish(
        self, subject: str, message: BusMessage, context: Context | None = None
    ) -> Future[None]:
        """Publish from any thread; returns a future (errors are logged, never raised here).

        ``context``: the request's trace context, so the ``bus.publish`` span and the message's
        traceparent join the request's trace instead of starting one of their own."""
        assert self._bus is not None
        future = asyncio.run_coroutine_threadsafe(
            _in_context(context, self._bus.publish(subject, message)), self._loop
        )
        future.add_done_callback(_log_failure)
        return future

    def subscribe(self, subject_filter: str, handler: SyncHandler) -> None:
        """Run ``handler(subject, message)`` on the bus thread for every valid message."""
        assert self._bus is not None
        bus = self._bus

        async def call(subject: str, message: BusMessage) -> None:
            handler(subject, message)

        asyncio.run_coroutine_threadsafe(bus.subscribe(subject_filter, call), self._loop).result(10)
        asyncio.run_coroutine_threadsafe(bus.flush(), self._loop).result(10)

    def close(self) -> None:
        with self._lock:
            if self._instances.get(self.config.url) is self:
                del self._instances[self.config.url]
        if self._bus is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._bus.drain(), self._loop).result(5)
            except Exception as exc:  # closing anyway
                log.debug("bus drain on close: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


async def _in_context(context: Context | None, work: Coroutine[Any, Any, None]) -> None:
    token = otel_context.attach(context) if context is not None else None
    try:
        await work
    finally:
        if token is not None:
            otel_context.detach(token)


def _log_failure(future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("kvpush connector publish failed: %s", exc)
