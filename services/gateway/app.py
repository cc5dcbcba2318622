"""The gateway service: lifecycle (setup -> start -> cleanup) and the CLI entry points.

Its configuration (``GatewayConfig``, flags, environment) is ``config``'s.
``Gateway.start(config)`` reads the model folder (``model``) and builds vLLM's serving layer
(``vllm_serving``; the engines then see the token ids it renders), connects its own NATS
connection, subscribes to ``kvpush.v1.heartbeat.*.*`` (worker registry),
``kvpush.v1.tokens.<gateway_id>`` (token streams) and ``kvpush.v1.cache.*.*`` (the workers'
prefix caches: ``prefix_index``, which the router asks; a ``CacheSync`` on
``kvpush.v1.cache.sync`` asks each worker for a snapshot when it joins the registry, so at
start, and again when the index missed its events), and serves the aiohttp app on
``--host``/``--port``, or on the listening socket a parent bound for it (``--listen-fd``:
``kvpush up``); ``.url`` is where.
``stop()`` drains: new requests get 503 and ``/ready`` turns 503, in-flight requests get
``shutdown_grace_s`` to finish, the rest are failed and aborted, then HTTP, subscriptions and
NATS close (pending publishes flushed). ``serve(args)`` runs one gateway until SIGTERM/SIGINT
and stops it gracefully; ``main(args)`` wraps it for the CLI (exit 0 after a clean stop, 1 when
NATS is unreachable, 2 on bad config).

Threading model: everything runs on one asyncio loop; the model folder and vLLM's serving layer
are loaded on a worker thread at start (vLLM's renderer tokenizes on its own thread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable

from aiohttp import web
from nats.aio.subscription import Subscription

from kvpush.connector import Bus, BusConfig, BusConnectError, configure_tracing
from kvpush.schemas import subjects
from kvpush.schemas.messages import CacheSync
from kvpush.services.gateway.config import ConfigError, GatewayConfig
from kvpush.services.gateway.http_server import GatewayApi
from kvpush.services.gateway.metrics import GatewayMetrics
from kvpush.services.gateway.model import ModelInfo, load_model
from kvpush.services.gateway.prefix_index import PrefixIndex
from kvpush.services.gateway.routing import Router
from kvpush.services.gateway.streaming import TokenStreams
from kvpush.services.gateway.vllm_serving import build_serving
from kvpush.services.gateway.worker_registry import WorkerRegistry
from kvpush.services.membership import Member
from kvpush.services.settings import apply_gil_switch

log = logging.getLogger(__name__)


class Gateway:
    """One running gateway; use ``await Gateway.start(config)`` and ``await gateway.stop()``."""

    def __init__(self, config: GatewayConfig, model: ModelInfo, bus: Bus) -> None:
        self.config, self.model, self.bus = config, model, bus
        self.metrics = GatewayMetrics()
        self.registry = WorkerRegistry(config.worker_lease_s, model=model.served_name)
        self.prefix_index = PrefixIndex(
            config.prefix_index_max_blocks, request_sync=self._ask_cache_sync
        )
        self.registry.membership.listeners.joined.append(self._cache_joined)
        self.registry.membership.listeners.left.append(self._cache_left)
        self.router = Router(
            self.registry,
            config.mode,
            config.local_threshold,
            prefix=self.prefix_index,
            routing=config.routing,
        )
        self.streams = TokenStreams(bus, config.gateway_id, config.stream_buffer_chunks)
        self.api = GatewayApi(
            config, model, bus, self.router, self.streams, self.metrics, self._spawn
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeats: Subscription | None = None
        self._kv_events: Subscription | None = None
        self._cache_events: Subscription | None = None
        self._runner: web.AppRunner | None = None
        self._stopped = False
        self.url = ""
        self.metrics.watch(self.registry, self.streams.stats)

    @classmethod
    async def start(cls, config: GatewayConfig) -> Gateway:
        """setup -> start: read the model folder, build vLLM's serving layer, connect,
        subscribe, listen."""
        model = await asyncio.to_thread(load_model, config)
        serving = await asyncio.to_thread(
            build_serving, config, model.served_name, model.max_model_len
        )
        bus_name = f"kvpush-gateway-{config.gateway_id}"
        bus = await Bus.connect(BusConfig.from_env(config.nats_url, bus_name))
        gateway = cls(config, model, bus)
        try:
            from kvpush.services.gateway.engine_client import BusEngineClient

            await serving.init(BusEngineClient(serving, gateway.api))
            gateway.api.attach(serving)
            await gateway._setup()
        except BaseException:
            await gateway.stop(grace_s=0)
            raise
        log.info(
            "gateway %s serving %s (max_model_len %d, mode %s) at %s",
            config.gateway_id,
            model.served_name,
            model.max_model_len,
            config.mode.value,
            gateway.url,
        )
        return gateway

    async def _setup(self) -> None:
        await self.streams.start()
        # before the heartbeats: a worker that joins is asked for a snapshot of its cache
        self._cache_events = await self.bus.subscribe(
            subjects.cache_events_all(), self.prefix_index.on_message, span=False
        )
        self._heartbeats = await self.bus.subscribe(subjects.heartbeats(), self.registry.on_message)
        self._kv_events = await self.bus.subscribe(subjects.kv_events(), self._on_kv, span=False)
        app = web.Application(client_max_size=self.config.max_body_bytes)
        self.api.add_routes(app)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await self._site(self._runner).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def _site(self, runner: web.AppRunner) -> web.BaseSite:
        """Where it listens: the socket a parent bound for it (``--listen-fd``), else
        ``--host``/``--port``."""
        fd = self.config.listen_fd
        if fd is None:
            return web.TCPSite(runner, self.config.host, self.config.port)
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"--listen-fd {fd}: no socket there ({exc})") from None
        sock.set_inheritable(False)  # ours alone, not the processes vLLM starts
        return web.SockSite(runner, sock)

    async def _on_kv(self, subject: str, message: object) -> None:
        """KvPushed / KvReady / KvFailed: counted (``observer``), and what a transfer cost
        teaches the router's cost model."""
        await self.api.observer.on_kv_event(subject, message)
        await self.router.costs.on_kv_event(subject, message)

    def _ask_cache_sync(self, workers: list[str]) -> None:
        """Ask ``workers`` (empty: all) for snapshots of their prefix caches."""
        ask = CacheSync(sender=self.config.gateway_id, workers=workers)
        self._spawn(self.bus.publish(subjects.cache_sync(), ask, span=False))

    def _cache_joined(self, member: Member) -> None:
        hb = member.heartbeat
        self.prefix_index.joined(hb.worker_id, hb.epoch, hb.total_blocks)

    def _cache_left(self, member: Member) -> None:
        self.prefix_index.forget(member.heartbeat.worker_id, member.heartbeat.epoch)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def in_flight(self) -> int:
        return self.api.in_flight

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and clean up (idempotent); see the module docstring."""
        if self._stopped:
            return
        self._stopped = True
        self.api.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.shutdown_grace_s if grace_s is None else grace_s)
        while self.api.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await self.streams.stop()  # fails what is still running: those requests abort
        if self._runner is not None:
            await self._runner.cleanup()
        for subscription in (self._heartbeats, self._kv_events, self._cache_events):
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        with contextlib.suppress(Exception):
            await self.bus.drain()
        log.info("gateway %s stopped", self.config.gateway_id)


async def serve(args: argparse.Namespace) -> int:
    """Run one gateway until SIGTERM or SIGINT, then stop it gracefully."""
    config = GatewayConfig.from_args(args)
    configure_tracing("kvpush-gateway", config.trace_file)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        gateway = await Gateway.start(config)
        print(
            f"kvpush gateway {config.gateway_id}: {gateway.model.served_name} at {gateway.url}",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
        log.info("gateway %s: signal received, draining", config.gateway_id)
        await gateway.stop()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0


def main(args: argparse.Namespace) -> int:
    """CLI entry: ``kvpush gateway ...``."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        apply_gil_switch()
        return asyncio.run(serve(args))
    except ConfigError as exc:
        print(f"kvpush gateway: {exc}", file=sys.stderr)
        return 2
    except BusConnectError as exc:
        print(f"kvpush gateway: {exc}", file=sys.stderr)
        return 1
