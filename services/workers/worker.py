"""The common worker service: config, lifecycle, request bookkeeping, aborts, heartbeats, drain.

``Worker`` owns one engine host (``core_engine.engine_host``: a ``CoreEngineHost``, vLLM's
``AsyncLLM`` with its engine-core process, as ``vllm serve`` runs it, the CUDA default; or an
``EngineHost``, a sync engine stepped on a thread of this process only when there is work, the
CPU default: ``--engine-core``), one ``Bus`` connection, the in-flight map (transfer_id ->
``InFlight``, inflight.py; the engine request id *is* the transfer id), its heartbeats
(``heartbeats.Heartbeats``: every ``heartbeat_s``, stating its ``lease_s``, and its entry in the
JetStream KV bucket of ``registry``, which seeds a starting peer's view), the view of the other
role's workers (``peers``: ``PeerWatch``, ``services.membership``), and with ``--metrics-port``
(or ``--metrics-fd``, a socket its parent bound) vLLM's own engine metrics (the ``vllm:*``
series its engine records in this process) on ``/metrics``, with a decode worker's KV checks
(``worker_metrics``).
``PrefillWorker`` / ``DecodeWorker`` add what a request means for their role (``serve``,
``refuse``) and what a gone peer held means for them.

A worker that finds its own heartbeats stalled past its lease (stopped, SIGSTOP, or its loop
blocked) knows its peers counted it gone and released what it held: it aborts every request it
holds and takes a new epoch, so it joins again as a new member.

Lifecycle (every kvpush service has this shape): ``setup`` (bus, engine, registry) -> ``start``
(subscriptions, heartbeats) -> run until SIGTERM/SIGINT -> ``drain`` (heartbeat draining=True,
stop taking requests, finish in-flight ones and the connector's pending transfers) ->
``cleanup`` (deregister, stop the engine, close the bus). ``run`` does all of it and returns 0.

Threading model: one asyncio loop on the main thread runs bus handlers, one task per request and
the heartbeat task; the engine host runs the engine on its own thread (``EngineHost``:
``kvpush-engine``, the connector's worker half too; ``CoreEngineHost``: vLLM's client on
``kvpush-engine-client``, the engine in its own process) and feeds request outputs back; the
connector keeps its own NATS connection on its ``kvpush-bus`` thread, vLLM's KV cache events
are read on ``kvpush-kv-events`` (``cache_events``), the metrics server runs on its own daemon
thread (``worker_metrics.serve_metrics``). Bounds: at most
``max_inflight`` requests (past it the role's ``refuse`` answers at once), the abort memory
holds ``ABORT_MEMORY`` transfer ids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import Any, ClassVar

from nats.aio.subscription import Subscription

from kvpush.connector import (
    BoundedDict,
    Bus,
    BusConfig,
    BusConnectError,
    configure_tracing,
)
from kvpush.schemas import subjects
from kvpush.schemas.messages import (
    Abort,
    FailReason,
    RequestEvent,
    SamplingSpec,
    WorkerHeartbeat,
    WorkerRole,
)
from kvpush.services.settings import ConfigError, apply_gil_switch
from kvpush.services.workers.cache_publisher import CachePublisher
from kvpush.services.workers.config import WorkerConfig, config_from_args
from kvpush.services.workers.core_engine import engine_host
from kvpush.services.workers.handles import RequestHandle
from kvpush.services.workers.heartbeats import Heartbeats
from kvpush.services.workers.inflight import InFlight
from kvpush.services.workers.peers import PeerWatch
from kvpush.services.workers.registry import Registry
from kvpush.services.workers.worker_metrics import (
    IntegrityCollector,
    serve_metrics,
    worker_registry,
)

log = logging.getLogger(__name__)

STALLED = "worker stalled past its lease"  # the abort reason of what a stalled worker held

ABORT_MEMORY = 4096
DEADLINE_GRACE_S = 1.0  # a request still running this long past its deadline is aborted


def now_ms() -> int:
    return int(time.time() * 1000)


class Worker:
    """A prefill or decode worker; the module docstring describes lifecycle and threads."""

    role: ClassVar[WorkerRole]

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.epoch = now_ms()
        self.host = engine_host(config.engine_config())
        self.side_channel = ""
        self.side_channels: list[str] = []  # every TP rank's, by rank (side_channel: rank 0's)
        self.gpu = config.gpu_identity  # heartbeats name it: workers on one GPU take turns
        self._bus: Bus | None = None
        self._registry: Registry | None = None  # None without JetStream
        self._metrics: Any = None  # --metrics-port / --metrics-fd: the HTTP server
        self._integrity: IntegrityCollector | None = None  # ... and a decode worker's KV checks
        self._inflight: dict[str, InFlight] = {}
        self._aborted: BoundedDict[str, str] = BoundedDict(ABORT_MEMORY)
        self._request_subs: list[Subscription] = []
        self._beats: Heartbeats | None = None  # from start()
        self._cache: CachePublisher | None = None  # --kv-events on: from start()
        other = WorkerRole.PREFILL if self.role is WorkerRole.DECODE else WorkerRole.DECODE
        self.peers = PeerWatch(other, config.lease_s)
        self._draining = False
        self._stop = asyncio.Event()

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "setup() first"
        return self._bus

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    # ---- role hooks -------------------------------------------------------------------------
    def request_filter(self) -> str:
        raise NotImplementedError

    def accepts(self, event: RequestEvent) -> bool:
        """False: the event is not for this role (ignored without an answer)."""
        return True

    async def serve(self, entry: InFlight) -> None:
        raise NotImplementedError

    async def refuse(self, event: RequestEvent, reason: FailReason, detail: str = "") -> None:
        raise NotImplementedError

    async def on_start(self) -> None:
        """Extra subscriptions of the role, made before the first heartbeat."""

    # ---- lifecycle --------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.config
        started = time.monotonic()
        self._bus = await Bus.connect(BusConfig.from_env(cfg.nats_url, cfg.worker_id))
        log.info(
            "%s %s: starting the engine (model %s)", self.role.value, cfg.worker_id, cfg.model_dir
        )
        if cfg.metrics_served:  # what vLLM's engine records (stats on) in this process
            served = worker_registry()  # vllm:* (process-global) and this worker's own series
            self._metrics = serve_metrics(
                served, cfg.side_channel_host, cfg.metrics_port, cfg.metrics_fd
            )
            host, port = self._metrics.server_address[:2]
            log.info("engine metrics (vllm:*) at http://%s:%d/metrics", host, port)
            if self.role is WorkerRole.DECODE:  # the link is the built engine's: read it late
                self._integrity = IntegrityCollector(
                    lambda: self.host.link.integrity_counts(), served
                )
        await asyncio.to_thread(self.host.start, lambda msg: log.info("engine: %s", msg))
        self.side_channels = [info.side_channel for info in self.host.link.ranks]
        self.side_channel = self.side_channels[0] if self.side_channels else ""
        self._registry = await Registry.open(self.bus, cfg.registry_ttl_s, cfg.registry_replicas)
        log.info(
            "%s %s ready in %.1f s: model %s, %d blocks, side channel %s, cores %s",
            self.role.value,
            cfg.worker_id,
            time.monotonic() - started,
            cfg.model_name,
            self.host.total_blocks(),
            self.side_channel,
            cfg.cpu_cores or "all",
        )

    async def start(self) -> None:
        await self.bus.subscribe(subjects.abort(self.worker_id), self._on_abort)
        await self.peers.start(self.bus, self.registry_entries)
        await self.on_start()
        if self.config.kv_events_endpoint:  # what the prefix cache holds, for the gateways
            endpoint, blocks = self.config.kv_events_endpoint, self.host.total_blocks()
            self._cache = await CachePublisher.open(
                self.bus, self.role, self.worker_id, endpoint, blocks, lambda: self.epoch
            )
        sub = await self.bus.subscribe(self.request_filter(), self._on_request)
        self._request_subs.append(sub)
        await self.bus.flush()
        cfg = self.config
        self._beats = Heartbeats(
            self.bus, self._registry, self.heartbeat, self._rejoin, cfg.heartbeat_s, cfg.lease_s
        )
        self._beats.start()

    async def drain(self) -> None:
        """Stop taking requests, finish the in-flight ones, then the connector's transfers."""
        cfg = self.config
        self._draining = True
        log.info("draining: %d request(s) in flight", len(self._inflight))
        if self._beats is not None:
            await self._beats.beat()  # the gateway stops routing here
        await asyncio.sleep(cfg.drain_grace_s)  # requests published before it saw the beat
        for sub in self._request_subs:
            with contextlib.suppress(Exception):
                await sub.drain()  # delivers what is pending, then unsubscribes
        self._request_subs.clear()
        deadline = time.monotonic() + cfg.drain_timeout_s
        tasks = [e.task for e in self._inflight.values() if e.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=cfg.drain_timeout_s)
            for entry in list(self._inflight.values()):
                log.warning(
                    "drain timeout: aborting rid=%s tid=%s",
                    entry.event.request_id,
                    entry.event.transfer_id,
                )
                self._abort(entry, "shutdown")
            if late:
                await asyncio.wait(late, timeout=5.0)
        pending = self.host.link.pending  # an engine-core process is asked over RPC: a thread
        while await asyncio.to_thread(pending) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # P's pushes still in flight: D's blocks depend on them
        log.info("drained (connector transfers pending: %d)", await asyncio.to_thread(pending))

    async def cleanup(self) -> None:
        if self._cache is not None:
            await self._cache.stop()
        await self.peers.stop()
        if self._beats is not None:  # bounded: NATS may be gone already
            await self._beats.stop(self.role, self.worker_id)
        if self._integrity is not None:  # no scrape asks a stopping engine
            self._integrity.close()
        await asyncio.to_thread(self.host.stop)
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._bus.drain(), 5.0)

    async def run(self) -> int:
        """setup -> start -> (SIGTERM/SIGINT) -> drain -> cleanup; 0 on a clean stop, 1 when
        it could not start."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            await self.setup()
            if not self._stop.is_set():
                await self.start()
                await self._stop.wait()
                await self.drain()
        except (BusConnectError, RuntimeError) as exc:  # no NATS, or the engine did not build
            trace = not isinstance(exc, BusConnectError)
            log.error("%s %s failed: %s", self.role.value, self.worker_id, exc, exc_info=trace)
            return 1
        finally:
            await self.cleanup()
        log.info("%s %s stopped", self.role.value, self.worker_id)
        return 0

    def stop(self) -> None:
        """Ask ``run`` to drain and return (what SIGTERM does)."""
        self._stop.set()

    # ---- requests ---------------------------------------------------------------------------
    async def _on_request(self, subject: str, message: object) -> None:
        if not isinstance(message, RequestEvent) or not self.accepts(message):
            return
        event, tid = message, message.transfer_id
        if tid in self._inflight or tid in self._aborted:
            log.warning(
                "dropping request rid=%s tid=%s: %s",
                event.request_id,
                tid,
                "duplicate" if tid in self._inflight else "aborted before it arrived",
            )
            return
        if event.model != self.config.model_name:
            detail = f"model {event.model!r} is not served by {self.worker_id}"
            await self.refuse(event, FailReason.PREFILL, detail)
            return
        late_ms = now_ms() - event.deadline_ms
        if event.deadline_ms and late_ms >= 0:
            await self.refuse(event, FailReason.DEADLINE, "deadline")
            return
        if len(self._inflight) >= self.config.max_inflight:
            log.warning("overloaded: refusing rid=%s tid=%s", event.request_id, tid)
            await self.refuse(event, FailReason.OVERLOADED, "overloaded")
            return
        entry = InFlight(event, time.time_ns())
        self._inflight[tid] = entry
        if event.deadline_ms:  # a backstop: the gateway answers and aborts at the deadline
            delay = -late_ms / 1000.0 + DEADLINE_GRACE_S
            entry.timer = asyncio.get_running_loop().call_later(
                delay, self._abort, entry, "deadline"
            )
        entry.task = asyncio.create_task(self._serve(entry), name=f"serve-{tid}")

    async def _serve(self, entry: InFlight) -> None:
        event = entry.event
        try:
            await self.serve(entry)
        except Exception as exc:
            log.exception("serving rid=%s tid=%s failed", event.request_id, event.transfer_id)
            if entry.handle is None:  # it never reached the engine: nothing of it runs
                with contextlib.suppress(Exception):
                    await self.refuse(event, FailReason.PREFILL, f"worker error: {exc!r}"[:500])
            else:
                self._abort(entry, "worker error")
        finally:
            if entry.timer is not None:
                entry.timer.cancel()
            self._inflight.pop(event.transfer_id, None)

    def submit(
        self, entry: InFlight, sampling: SamplingSpec, kv_params: dict[str, Any] | None
    ) -> RequestHandle | None:
        """Hand the request to the engine; None when it was aborted before that."""
        if entry.aborted is not None:
            return None
        event = entry.event
        entry.handle = self.host.submit(
            event.transfer_id, event.prompt_token_ids, sampling, kv_transfer_params=kv_params
        )
        return entry.handle

    # ---- aborts -----------------------------------------------------------------------------
    async def _on_abort(self, subject: str, message: object) -> None:
        if not isinstance(message, Abort):
            return  # AbortAcks on this subject are the connector's business
        entry = self._inflight.get(message.transfer_id)
        if entry is None:
            self._aborted[message.transfer_id] = message.reason
            return
        self._abort(entry, message.reason or f"aborted by {message.sender}")

    def _abort(self, entry: InFlight, reason: str) -> None:
        if entry.aborted is not None:
            return
        entry.aborted = reason
        log.info(
            "aborting rid=%s tid=%s: %s", entry.event.request_id, entry.event.transfer_id, reason
        )
        if entry.handle is not None:
            try:
                self.host.abort(entry.event.transfer_id)
            except RuntimeError as exc:  # the engine is stopping or its queue is full
                log.warning("abort of tid=%s failed: %s", entry.event.transfer_id, exc)

    # ---- heartbeats and registry ------------------------------------------------------------
    def heartbeat(self) -> WorkerHeartbeat:
        waiting = sum(1 for e in self._inflight.values() if e.queued_for_prefill(self.role))
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.role,
            epoch=self.epoch,
            model=self.config.model_name,
            side_channel=self.side_channel,
            side_channels=self.side_channels,
            in_flight=len(self._inflight),
            queue_depth=waiting,
            # what the engine left after its last step: a long step (the first ones of a TP
            # engine take seconds on a busy CPU) must not hold the beat past the lease
            free_blocks=self.host.last_free_blocks,
            total_blocks=self.host.total_blocks(),
            sent_at_ms=now_ms(),
            draining=self._draining,
            sends_first_token=self.role is WorkerRole.PREFILL,  # prefill.py: FirstToken
            lease_ms=int(self.config.lease_s * 1000),
            gpu=self.gpu,
        )

    async def registry_entries(self, role: WorkerRole) -> list[WorkerHeartbeat]:
        """Live workers of ``role`` from the registry (empty without one)."""
        return await self._registry.entries(role) if self._registry is not None else []

    def _rejoin(self, stalled_s: float) -> None:
        """Our heartbeats stalled past the lease: peers released what we held."""
        log.warning(
            "heartbeats stalled %.1f s, past the %.1f s lease: aborting %d request(s),"
            " joining again with a new epoch",
            stalled_s,
            self.config.lease_s,
            len(self._inflight),
        )
        for entry in list(self._inflight.values()):
            self._abort(entry, STALLED)
        self.epoch = max(now_ms(), self.epoch + 1)


def run_worker(worker_cls: type[Worker], args: argparse.Namespace) -> int:
    """Entry point of ``kvpush prefill`` / ``kvpush decode``: config, logging, run (exit 2 and
    one line on an unusable setting)."""
    try:
        config = config_from_args(worker_cls.role, args)
        apply_gil_switch()
    except ConfigError as exc:
        print(f"kvpush {worker_cls.role.value}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {config.worker_id} %(name)s: %(message)s",
    )
    configure_tracing(f"kvpush-{worker_cls.role.value}", config.trace_file)
    return asyncio.run(worker_cls(config).run())
