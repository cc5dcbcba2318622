"""The gateway service: config, lifecycle (setup -> start -> cleanup) and the CLI entry points.

``GatewayConfig.from_args`` is the one place flags and environment variables become config
(flag > ``KVPUSH_*`` env var > default). ``Gateway.start(config)`` loads the tokenizer (once;
both engines then see the gateway's token ids), connects its own NATS connection, subscribes to
``kvpush.v1.heartbeat.*.*`` (worker registry) and ``kvpush.v1.tokens.<gateway_id>`` (token
streams), and serves the aiohttp app; ``.url`` is where. ``stop()`` drains: new requests get
503 and ``/ready`` turns 503, in-flight requests get ``shutdown_grace_s`` to finish, the rest are
failed and aborted, then HTTP, subscriptions and NATS close (pending publishes flushed).
``serve(args)`` runs one gateway until SIGTERM/SIGINT and stops it gracefully; ``main(args)``
wraps it for the CLI (exit 0 after a clean stop, 1 when NATS is unreachable, 2 on bad config).

Threading model: everything runs on one asyncio loop; the tokenizer is loaded on a worker
thread at start and tokenization runs on one dedicated thread (see ``handlers``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from nats.aio.subscription import Subscription

from kvpush.schemas import subjects
from kvpush.schemas.messages import TransferMode, WorkerRole
from kvpush.services import telemetry
from kvpush.services.bus import Bus, BusConfig, BusConnectError
from kvpush.services.gateway.handlers import GatewayApi
from kvpush.services.gateway.metrics import GatewayMetrics
from kvpush.services.gateway.model import ConfigError, ModelInfo, load_model
from kvpush.services.gateway.routing import Router, WorkerRegistry
from kvpush.services.gateway.streaming import TokenStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # model folder (tokenizer, config.json, optional kvpush-model.json stamp)
    served_model_name: str | None = None  # default: the stamp's recipe name, else folder name
    max_model_len: int | None = None  # default: stamp max_context / config.json
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    nats_url: str = "nats://127.0.0.1:4222"
    gateway_id: str = dataclasses.field(default_factory=lambda: f"gw-{secrets.token_hex(4)}")
    mode: TransferMode = TransferMode.PUSH  # deployment default: push or pull
    local_threshold: int = 256  # prompts shorter than this (tokens) go LOCAL; 0 disables
    max_inflight: int = 256
    request_timeout_s: float = 300.0
    api_keys: tuple[str, ...] = ()
    worker_lease_s: float = 3.0  # a worker is alive while heartbeats arrive within this
    max_body_bytes: int = 8 * 1024 * 1024
    stream_buffer_chunks: int = 4096  # per request; beyond it the request fails
    shutdown_grace_s: float = 30.0
    trace_file: str | None = None  # JSON-lines span file (also: OTEL_* variables)

    def __post_init__(self) -> None:
        subjects.check_id(self.gateway_id)
        if self.mode not in (TransferMode.PUSH, TransferMode.PULL):
            raise ConfigError("--mode must be push or pull")
        positive = ("max_inflight", "request_timeout_s", "worker_lease_s", "max_body_bytes")
        for name in (*positive, "stream_buffer_chunks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.local_threshold < 0 or not 0 <= self.port <= 65535:
            raise ConfigError("local_threshold must be >= 0 and port within 0..65535")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Flags (``add_arguments``) > environment (``KVPUSH_*``) > defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, (flag, env_name, convert, _help) in _OPTIONS.items():
            raw = getattr(args, name, None)
            if raw is None and env_name in env and env[env_name] != "":
                raw = env[env_name]
            if raw is None or raw == []:
                continue
            try:
                values[name] = convert(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{flag} / {env_name}: invalid value {raw!r} ({exc})") from None
        if "model" not in values:
            raise ConfigError("--model DIR (or KVPUSH_MODEL) is required")
        try:
            return cls(**values)
        except ValueError as exc:  # includes subjects.SubjectError for a bad gateway id
            raise ConfigError(str(exc)) from None

    def bus_config(self) -> BusConfig:
        return BusConfig.from_env(self.nats_url, f"kvpush-gateway-{self.gateway_id}")


def _keys(raw: str | list[str]) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else raw
    return tuple(k.strip() for k in items if k.strip())


_OPTIONS: dict[str, tuple[str, str, Any, str]] = {
    "model": ("--model", "KVPUSH_MODEL", str, "model folder: tokenizer + config.json"),
    "served_model_name": (
        "--served-model-name",
        "KVPUSH_SERVED_MODEL_NAME",
        str,
        "model name clients send (default: the stamp's name, else the folder's name)",
    ),
    "max_model_len": (
        "--max-model-len",
        "KVPUSH_MAX_MODEL_LEN",
        int,
        "context length (default: from the model folder)",
    ),
    "host": ("--host", "KVPUSH_GATEWAY_HOST", str, "listen address (default 127.0.0.1)"),
    "port": ("--port", "KVPUSH_GATEWAY_PORT", int, "listen port (default 8000; 0: any)"),
    "nats_url": ("--nats-url", "KVPUSH_NATS_URL", str, "NATS server URL(s), comma separated"),
    "gateway_id": (
        "--gateway-id",
        "KVPUSH_GATEWAY_ID",
        str,
        "this gateway's id (default gw-<random>)",
    ),
    "mode": ("--mode", "KVPUSH_MODE", TransferMode, "KV transfer mode: push (default) or pull"),
    "local_threshold": (
        "--local-threshold",
        "KVPUSH_LOCAL_THRESHOLD",
        int,
        "prompts shorter than this many tokens are served by D alone (default 256; 0: never)",
    ),
    "max_inflight": (
        "--max-inflight",
        "KVPUSH_MAX_INFLIGHT",
        int,
        "requests in flight before 429 (256)",
    ),
    "request_timeout_s": (
        "--request-timeout",
        "KVPUSH_REQUEST_TIMEOUT",
        float,
        "seconds per request (300)",
    ),
    "api_keys": (
        "--api-key",
        "KVPUSH_API_KEYS",
        _keys,
        "accepted Bearer key (repeatable; env: comma list); none: no auth",
    ),
    "worker_lease_s": (
        "--worker-lease",
        "KVPUSH_WORKER_LEASE",
        float,
        "seconds without heartbeat = dead (3)",
    ),
    "max_body_bytes": (
        "--max-body-bytes",
        "KVPUSH_MAX_BODY_BYTES",
        int,
        "largest request body (8 MiB)",
    ),
    "shutdown_grace_s": (
        "--shutdown-grace",
        "KVPUSH_SHUTDOWN_GRACE",
        float,
        "seconds in-flight requests get on SIGTERM (30)",
    ),
    "trace_file": (
        "--trace-file",
        "KVPUSH_TRACE_FILE",
        str,
        "append finished spans to this file as JSON lines (read with `kvpush ttft`)",
    ),
}


_METAVARS = {
    "trace_file": "PATH",
    "model": "DIR",
    "served_model_name": "NAME",
    "host": "ADDR",
    "port": "PORT",
    "nats_url": "URL",
    "gateway_id": "ID",
    "api_keys": "KEY",
    "request_timeout_s": "S",
    "worker_lease_s": "S",
    "shutdown_grace_s": "S",
    "max_body_bytes": "BYTES",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags (all optional here; ``from_args`` applies env and defaults)."""
    for name, (flag, env_name, convert, text) in _OPTIONS.items():
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": f"{text} [{env_name}]"}
        if name != "mode":
            kwargs["metavar"] = _METAVARS.get(name, "N")
        if name == "api_keys":
            kwargs["action"] = "append"
        elif name == "mode":
            kwargs["choices"] = ["push", "pull"]
        elif convert in (int, float):
            kwargs["type"] = convert
        parser.add_argument(flag, **kwargs)


class Gateway:
    """One running gateway; use ``await Gateway.start(config)`` and ``await gateway.stop()``."""

    def __init__(self, config: GatewayConfig, model: ModelInfo, bus: Bus) -> None:
        self.config, self.model, self.bus = config, model, bus
        self.metrics = GatewayMetrics()
        self.registry = WorkerRegistry(config.worker_lease_s, model=model.served_name)
        self.router = Router(self.registry, config.mode, config.local_threshold)
        self.streams = TokenStreams(bus, config.gateway_id, config.stream_buffer_chunks)
        self.api = GatewayApi(
            config, model, bus, self.router, self.streams, self.metrics, self._spawn
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeats: Subscription | None = None
        self._kv_events: Subscription | None = None
        self._runner: web.AppRunner | None = None
        self._stopped = False
        self.url = ""
        self._register_metric_sources()

    @classmethod
    async def start(cls, config: GatewayConfig, *, model: ModelInfo | None = None) -> Gateway:
        """setup -> start: load the model's tokenizer, connect, subscribe, listen."""
        model = model or await asyncio.to_thread(load_model, config)
        bus = await Bus.connect(config.bus_config())
        gateway = cls(config, model, bus)
        try:
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
        self._heartbeats = await self.bus.subscribe(subjects.heartbeats(), self.registry.on_message)
        self._kv_events = await self.bus.subscribe(
            subjects.kv_events(), self.api.observer.on_kv_event, span=False
        )
        app = web.Application(client_max_size=self.config.max_body_bytes)
        self.api.add_routes(app)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def _register_metric_sources(self) -> None:
        self.metrics.set_workers(
            lambda: [
                state.heartbeat
                for role in WorkerRole
                for state in self.registry.alive(role, include_draining=True)
            ]
        )
        self.metrics.add_source(
            "gauge",
            "kvpush_gateway_workers",
            "live, non-draining workers by role",
            "role",
            lambda: {k: float(v) for k, v in self.registry.counts().items()},
        )
        stats = self.streams.stats
        self.metrics.add_source(
            "counter",
            "kvpush_gateway_token_chunks",
            "token chunks received, by outcome",
            "outcome",
            lambda: {
                "delivered": stats.chunks,
                "unknown": stats.unknown,
                "duplicate": stats.duplicates,
                "reordered": stats.reordered,
                "overflow": stats.overflows,
            },
        )

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
        for subscription in (self._heartbeats, self._kv_events):
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        self.api.close()
        with contextlib.suppress(Exception):
            await self.bus.drain()
        log.info("gateway %s stopped", self.config.gateway_id)


async def serve(args: argparse.Namespace) -> int:
    """Run one gateway until SIGTERM or SIGINT, then stop it gracefully."""
    config = GatewayConfig.from_args(args)
    telemetry.configure("kvpush-gateway", config.trace_file)
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
        return asyncio.run(serve(args))
    except ConfigError as exc:
        print(f"kvpush gateway: {exc}", file=sys.stderr)
        return 2
    except BusConnectError as exc:
        print(f"kvpush gateway: {exc}", file=sys.stderr)
        return 1
