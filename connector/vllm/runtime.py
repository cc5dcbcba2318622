"""One engine's connector runtime: what a worker half shares with its sides.

vLLM builds the scheduler half and the worker halves of a connector as separate objects: one
scheduler half in the engine core's process, one worker half per TP rank (in that process with
the uniproc executor, in a worker process each with the multiprocess executor). Each worker half
owns one ``WorkerRuntime`` and one ``BusThread`` and hands both to its prefill or decode side;
nothing here is a module global, so two engines (or two TP ranks) in one process never share
state by chance. What the engine's driver must learn travels through vLLM's own channels (see
``scheduler.py``), never through this object.

``WorkerRuntime`` carries:

- ``notify()``: something happened that only an engine step can act on (a transfer finished or
  failed, an announcement or a KvReady arrived, an abort); it wakes the scheduler half's
  listener (``wake.py``), whatever process that is in.
- ``wake_at(t)``: ask for that ``notify`` at monotonic time ``t`` (a transfer's deadline, an
  abort's acknowledgement timeout), so a driver never has to step on a timer to notice one.
- ``suspect_peer`` / ``take_suspects``: side-channel addresses the worker service believes dead
  (a prefill worker's heartbeat lease ran out; they come down in the step metadata); the decode
  side probes them.
- ``info``: this rank's identity once its KV cache is registered (worker id, role, rank, side
  channel, compatibility hash), which vLLM hands to the scheduler half at start.
- ``marks``: the critical-path instants learned per transfer (``TimingMarks``), sent to the
  scheduler half with each step's output and put on the request's final output there.

Threading model: ``WorkerRuntime`` and ``TimingMarks`` are safe from any thread (one lock each);
``WakeTimer`` owns one daemon thread (started at its first deadline) that only calls ``notify``.
``BusThread`` owns one asyncio loop on a daemon thread named ``kvpush-bus``; callers on other
threads use ``publish`` (fire and forget, bounded by the loop's queue) and ``subscribe``
(handlers run on the bus thread and must be quick and thread-safe). ``close`` drains and stops
it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from kvpush.connector.bounded import BoundedDict
from kvpush.connector.bus import Bus, BusConfig
from kvpush.schemas.codec import BusMessage
from kvpush.schemas.messages import Timing

log = logging.getLogger(__name__)
MAX_MARKS = 8192
LATEST_WINS = frozenset({"kv_sent", "kv_landed"})
MAX_DEADLINES = 65536  # beyond: not timed (the driver's own longest sleep still bounds it)


class ConnectorInfo(msgspec.Struct, frozen=True):
    """A registered worker half: what its worker service announces in heartbeats."""

    worker_id: str
    role: str
    side_channel: str
    compat_hash: str
    rank: int = 0  # TP rank of this worker half
    tp_size: int = 1


class TimingMarks:
    """``Timing`` instants per transfer id, bounded (oldest dropped first); first value wins,
    but for the end of a transfer (``LATEST_WINS``), where the last rank's counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._marks: BoundedDict[str, dict[str, int]] = BoundedDict(MAX_MARKS)

    def record(self, transfer_id: str, **instants: int) -> None:
        """Remember ``Timing`` instants of a transfer (zeros ignored)."""
        with self._lock:
            entry = self._marks.get(transfer_id)
            if entry is None:
                entry = self._marks[transfer_id] = {}
            for field, value in instants.items():
                if not value:
                    continue
                if field in LATEST_WINS:  # with TP: the transfer ends with its last rank
                    entry[field] = max(value, entry.get(field, 0))
                elif not entry.get(field):
                    entry[field] = value

    def record_timing(self, transfer_id: str, timing: Timing | None) -> None:
        if timing is not None:
            self.record(transfer_id, **msgspec.structs.asdict(timing))

    def take_all(self) -> dict[str, Timing]:
        """Everything recorded so far, by transfer id (and forget it)."""
        with self._lock:
            entries = list(self._marks.items())
            self._marks.clear()
        return {tid: Timing(**entry) for tid, entry in entries if entry}

    def take(self, transfer_id: str, keep: bool = False) -> Timing | None:
        """The instants recorded for ``transfer_id`` so far (forgotten unless ``keep``); None
        if none."""
        with self._lock:
            entry = self._marks.get(transfer_id) if keep else self._marks.pop(transfer_id, None)
            return Timing(**entry) if entry else None


class WakeTimer:
    """Calls ``wake`` at every time given to ``at`` (the earliest first; one thread)."""

    def __init__(self, wake: Callable[[], None], limit: int = MAX_DEADLINES) -> None:
        self._wake = wake
        self.limit = limit
        self._cond = threading.Condition()
        self._times: list[float] = []
        self._closed = False
        self.dropped = 0  # deadlines not timed (the driver's longest sleep bounds them)
        self._thread: threading.Thread | None = None

    def at(self, when: float) -> None:
        with self._cond:
            if self._closed:
                return
            if len(self._times) >= self.limit:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "kvpush deadline timer full (%d): a deadline goes untimed", self.limit
                    )
                return
            heapq.heappush(self._times, when)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpush-timer", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._times or self._times[0] > time.monotonic()):
                    delay = self._times[0] - time.monotonic() if self._times else None
                    self._cond.wait(delay)
                if self._closed:
                    return
                while self._times and self._times[0] <= time.monotonic():
                    heapq.heappop(self._times)
            self._wake()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class WorkerRuntime:
    """The worker half's shared state; see the module docstring."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self.notify = wake  # ask for an engine step soon (the scheduler half's listener wakes)
        self.timer = WakeTimer(wake)
        self.marks = TimingMarks()
        self.info: ConnectorInfo | None = None
        self._lock = threading.Lock()
        self._suspects: set[str] = set()

    def wake_at(self, when: float) -> None:
        """Ask for ``notify`` at monotonic time ``when`` (a little after a deadline)."""
        self.timer.at(when + 0.01)

    def suspect_peer(self, address: str) -> None:
        """A peer's side channel that may be dead (its heartbeat lease ran out, or it came back
        with a new epoch): the decode side probes it and, if it does not answer, fails what is in
        flight from it at once (D computes those prompts itself) instead of at the deadline."""
        with self._lock:
            self._suspects.add(address)
        self.notify()

    def take_suspects(self) -> set[str]:
        with self._lock:
            taken, self._suspects = self._suspects, set()
        return taken


SyncHandler = Callable[[str, BusMessage], None]


class BusThread:
    """One NATS connection on its own asyncio thread, owned by one worker half."""

    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvpush-bus", daemon=True)
        self._thread.start()
        connecting = asyncio.run_coroutine_threadsafe(Bus.connect(config), self._loop)
        try:
            self._bus = connecting.result(config.initial_connect_timeout_s + 5)
        except BaseException as exc:
            connecting.cancel()
            self._loop.call_soon_threadsafe(self._loop.stop)
            if isinstance(exc, FutureTimeout):
                raise ConnectionError(
                    f"kvpush connector: no NATS connection to {config.url}"
                ) from None
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        # Stopped (close(), or a failed connect): end what the client left running, then close
        # the loop quietly.
        leftover = asyncio.all_tasks(self._loop)
        for task in leftover:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        self._loop.close()

    def publish(
        self,
        subject: str,
        message: BusMessage,
        context: Context | None = None,
        span: bool = True,
    ) -> Future[None]:
        """Publish from any thread; returns a future (errors are logged, never raised here).

        ``context``: the request's trace context, so the ``bus.publish`` span and the message's
        traceparent join the request's trace instead of starting one of their own; ``span=False``
        (hints) sends it outside any trace. The loop's task runs in a copy of this thread's
        context as it is now (``call_soon_threadsafe`` takes it), so attaching here suffices."""
        context = context if span else Context()  # empty: no traceparent goes with a hint
        token = otel_context.attach(context) if context is not None else None
        try:
            publishing = self._bus.publish(subject, message, span=span)
            future = asyncio.run_coroutine_threadsafe(publishing, self._loop)
        finally:
            if token is not None:
                otel_context.detach(token)
        future.add_done_callback(_log_failure)
        return future

    def subscribe(self, subject_filter: str, handler: SyncHandler) -> None:
        """Run ``handler(subject, message)`` on the bus thread for every valid message."""

        async def call(subject: str, message: BusMessage) -> None:
            handler(subject, message)

        subscribing = self._bus.subscribe(subject_filter, call)
        asyncio.run_coroutine_threadsafe(subscribing, self._loop).result(10)
        asyncio.run_coroutine_threadsafe(self._bus.flush(), self._loop).result(10)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._bus.drain(), self._loop).result(5)
            except Exception as exc:  # closing anyway
                log.debug("bus drain on close: %s", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def _log_failure(future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("kvpush connector publish failed: %s", exc)
