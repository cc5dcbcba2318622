"""Typed NATS bus client: connect, publish and subscribe kvpush v1 messages with trace context.

``Bus`` owns one nats-py connection. ``publish`` encodes a struct (``kvpush.schemas.codec``),
opens a PRODUCER span ``bus.publish`` and injects W3C ``traceparent`` into the NATS headers.
``subscribe`` decodes each message through the one decode path, opens a CONSUMER span
``bus.receive`` whose parent is the publisher's context (only for a message that carries one:
heartbeats make no root-span noise), and calls the handler inside it.
A malformed message is logged (at most once a second per subject kind) and counted in
``Bus.stats``; the subscription keeps running. A handler exception is logged and counted too.

Threading model: asyncio only, on the loop that called ``connect``. nats-py delivers each
subscription's messages one at a time on its own task, so a handler must return quickly (start
a task for long work). Every subscription has a pending bound (messages and bytes); past it
nats-py drops messages for that subscription and reports a slow consumer, counted in
``stats.dropped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import SlowConsumerError
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from kvpush.schemas import codec
from kvpush.schemas.codec import BusMessage, MessageError

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"  # the one default of every kvpush process
log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvpush.bus")

Handler = Callable[[str, BusMessage], Awaitable[None]]


@dataclass(frozen=True)
class BusConfig:
    """How to reach NATS. ``url`` may list several servers separated by commas."""

    url: str = DEFAULT_NATS_URL
    name: str = "kvpush"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    connect_timeout_s: float = 5.0  # one TCP/TLS connect attempt
    initial_connect_timeout_s: float = 15.0  # all attempts of the first connect together
    reconnect_wait_s: float = 0.5
    max_reconnect_attempts: int = -1  # -1: keep trying forever
    pending_msgs_limit: int = 8192
    pending_bytes_limit: int = 64 * 1024 * 1024

    @classmethod
    def from_env(
        cls, url: str, name: str, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> BusConfig:
        """``url`` and ``name`` plus the credentials every kvpush process reads from the
        environment (secrets stay out of argv and ``ps``): ``KVPUSH_NATS_USER`` /
        ``KVPUSH_NATS_PASSWORD``, ``KVPUSH_NATS_TOKEN``, ``KVPUSH_NATS_CREDS`` (a .creds file),
        ``KVPUSH_NATS_TLS_CA`` / ``KVPUSH_NATS_TLS_CERT`` / ``KVPUSH_NATS_TLS_KEY``. A URL may
        also carry ``user:password@`` or ``token@`` itself."""
        env = os.environ if env is None else env
        found = {key: env[var] for key, var in ENV_CREDENTIALS.items() if env.get(var)}
        return cls(**{"url": url, "name": name, **found, **overrides})

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca_file or self.tls_cert_file):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context


ENV_CREDENTIALS = {
    "user": "KVPUSH_NATS_USER",
    "password": "KVPUSH_NATS_PASSWORD",
    "token": "KVPUSH_NATS_TOKEN",
    "creds_file": "KVPUSH_NATS_CREDS",
    "tls_ca_file": "KVPUSH_NATS_TLS_CA",
    "tls_cert_file": "KVPUSH_NATS_TLS_CERT",
    "tls_key_file": "KVPUSH_NATS_TLS_KEY",
}


class BusConnectError(ConnectionError):
    """The first connection to NATS did not succeed in time; says why (last server error)."""


@dataclass
class BusStats:
    malformed: Counter[str] = field(default_factory=Counter)  # by MessageErrorKind value
    handler_errors: int = 0
    dropped: int = 0  # slow-consumer drops reported by nats-py
    reconnects: int = 0


class Bus:
    """One NATS connection carrying typed kvpush messages; see the module docstring."""

    def __init__(self, client: Client, config: BusConfig) -> None:
        self.client = client  # the nats-py client (JetStream / KV use it directly)
        self.config = config
        self.stats = BusStats()
        self._last_warning: dict[str, float] = {}

    @classmethod
    async def connect(cls, config: BusConfig) -> Bus:
        """Connect (retrying until ``initial_connect_timeout_s``), then reconnect forever."""
        bus: Bus | None = None
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            if bus is None:
                errors.append(exc)
                del errors[:-8]
            elif isinstance(exc, SlowConsumerError):
                bus.stats.dropped += 1
                bus._warn_limited("slow", "slow consumer on %s: message dropped", exc.subject)
            else:
                bus._warn_limited("error", "nats error: %s", exc)

        async def on_reconnect() -> None:
            if bus is not None:
                bus.stats.reconnects += 1
            log.info("nats reconnected to %s", client.connected_url)

        async def on_disconnect() -> None:
            if bus is not None and not client.is_closed:
                log.warning("nats disconnected; reconnecting")

        client = Client()
        connecting = client.connect(
            servers=[u.strip() for u in config.url.split(",") if u.strip()],
            name=config.name,
            user=config.user,
            password=config.password,
            token=config.token,
            user_credentials=config.creds_file,
            tls=config.tls_context(),
            connect_timeout=config.connect_timeout_s,
            reconnect_time_wait=config.reconnect_wait_s,
            max_reconnect_attempts=config.max_reconnect_attempts,
            error_cb=on_error,
            reconnected_cb=on_reconnect,
            disconnected_cb=on_disconnect,
        )
        try:
            await asyncio.wait_for(connecting, config.initial_connect_timeout_s)
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            await client.close()
            # the server's own word (e.g. Authorization Violation) says more than a reset socket
            said = [e for e in errors if isinstance(e, nats.errors.Error)]
            why = (said or errors or [exc])[-1]
            raise BusConnectError(f"cannot connect to NATS at {config.url}: {why!r}") from None
        bus = cls(client, config)
        return bus

    @property
    def is_connected(self) -> bool:
        return self.client.is_connected

    async def publish(self, subject: str, message: BusMessage, *, span: bool = True) -> None:
        """Encode and publish ``message``; the current trace context travels in the headers.

        ``span=False`` skips the ``bus.publish`` span (hot paths such as token chunks) but still
        propagates the caller's context.
        """
        payload = codec.encode(message)
        headers: dict[str, str] = {}
        if span:
            with _tracer.start_as_current_span(
                "bus.publish",
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": "nats",
                    "messaging.operation.type": "send",
                    "messaging.destination.name": subject,
                    "messaging.message.body.size": len(payload),
                },
            ):
                propagate.inject(headers)
                await self.client.publish(subject, payload, headers=headers or None)
        else:
            propagate.inject(headers)
            await self.client.publish(subject, payload, headers=headers or None)

    async def subscribe(
        self,
        subject_filter: str,
        handler: Handler,
        *,
        queue: str = "",
        pending_msgs_limit: int | None = None,
        span: bool = True,
    ) -> Subscription:
        """Deliver every valid message on ``subject_filter`` to ``handler(subject, message)``.

        ``span=False``: no ``bus.receive`` span (hot paths such as token chunks)."""

        async def on_message(msg: Msg) -> None:
            try:
                message = codec.decode(msg.subject, msg.data)
            except MessageError as exc:
                self.stats.malformed[exc.kind.value] += 1
                self._warn_limited(
                    exc.kind.value, "dropped bad message on %s: %s", msg.subject, exc
                )
                return
            # No trace to join (heartbeats, token chunks): no span, no root-span noise.
            traced = span and msg.headers and "traceparent" in msg.headers
            with (
                _tracer.start_as_current_span(
                    "bus.receive",
                    context=propagate.extract(msg.headers),
                    kind=SpanKind.CONSUMER,
                    attributes={
                        "messaging.system": "nats",
                        "messaging.operation.type": "receive",
                        "messaging.destination.name": msg.subject,
                    },
                )
                if traced
                else contextlib.nullcontext()
            ):
                try:
                    await handler(msg.subject, message)
                except Exception:
                    self.stats.handler_errors += 1
                    log.exception("handler for %s failed on %s", subject_filter, msg.subject)

        return await self.client.subscribe(
            subject_filter,
            queue=queue,
            cb=on_message,
            pending_msgs_limit=pending_msgs_limit or self.config.pending_msgs_limit,
            pending_bytes_limit=self.config.pending_bytes_limit,
        )

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once the server has processed every command this bus sent before the call
        (subscriptions included: another connection's publish after this reaches them).

        nats-py's ``Client.flush`` alone does not promise that: it writes its PING straight to
        the socket while earlier SUB/PUB commands may still sit in the client's pending buffer,
        waiting for its flusher task, so the PONG can come back before the server has seen them
        (seen here: a subscription made and flushed missed the next publish of another client,
        about 1 run in 40). So first hand the pending buffer to the socket and wait for that
        (``force_flush``), then ping.
        """
        # One deadline for both steps. ``_flush_pending`` (private; nats-py 2.16.0 is pinned)
        # swallows a cancellation and returns as if done, so asyncio.wait_for could not tell a
        # timeout: time it with asyncio.wait, and cancel it only once it is late.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        handed = asyncio.ensure_future(self.client._flush_pending(force_flush=True))
        done, _ = await asyncio.wait({handed}, timeout=timeout_s)
        if not done:
            handed.cancel()
            raise nats.errors.FlushTimeoutError
        await self.client.flush(timeout=max(deadline - loop.time(), 0.001))

    async def drain(self) -> None:
        """Stop receiving, deliver what is pending, flush publishes, close."""
        if not self.client.is_closed:
            await self.client.drain()

    async def close(self) -> None:
        if not self.client.is_closed:
            await self.client.close()

    def _warn_limited(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning.get(key, 0.0) >= 1.0:
            self._last_warning[key] = now
            log.warning(fmt, *args)
