"""The gateway's HTTP server: routes, auth, OpenAI error bodies, admission, abort publishing.

``GatewayApi`` owns the aiohttp routes: the OpenAI ones answered by vLLM's serving layer
(``openai_routes.OpenAIRoutes``, attached once it is built: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/version``) and
kvpush's own (``/health``, ``/ready``, ``/metrics``, ``/dashboard`` with ``/dashboard/data``,
``/openapi.json`` from ``openapi_doc``); one middleware (Bearer API keys on ``/v1/*``; every
error, including aiohttp's own 404/405/413, answered as OpenAI error JSON, 429/503 with
``Retry-After``; any unexpected exception logged and answered as a bare 500, never a stack
trace; request counts); admission (``admit``: the draining flag's 503, ``admission.Admission``'s
bounded queue, then 429, the ``gateway.request`` span, the wait for the first workers); and
abort publishing. One engine request on the bus is ``bus_generation.BusGeneration``'s (this is
its ``GenerationHost``); what is learned after a request (breakdown, KV transfers) is
``observe.Observer``'s.

Threading model: every handler runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from kvpush.connector import Bus
from kvpush.schemas import subjects
from kvpush.schemas.messages import Abort
from kvpush.services.gateway import cors, dashboard, openapi_doc
from kvpush.services.gateway.admission import Admission
from kvpush.services.gateway.dashboard import RecentRequests
from kvpush.services.gateway.errors import ApiError, error_body, json_response
from kvpush.services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kvpush.services.gateway.observe import Observer
from kvpush.services.gateway.openai_routes import OpenAIRoutes
from kvpush.services.gateway.routing import Route, Router
from kvpush.services.gateway.streaming import TokenStreams

if TYPE_CHECKING:
    from kvpush.services.gateway.config import GatewayConfig
    from kvpush.services.gateway.model import ModelInfo
    from kvpush.services.gateway.vllm_serving import VllmServing

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvpush.gateway")
ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"}
)


class GatewayApi:
    """Handlers plus the per-gateway request state (in-flight count, draining flag)."""

    def __init__(
        self,
        config: GatewayConfig,
        model: ModelInfo,
        bus: Bus,
        router: Router,
        streams: TokenStreams,
        metrics: GatewayMetrics,
        spawn: Callable[[Awaitable[None]], None],
    ) -> None:
        self.config, self.model, self.bus, self.router = config, model, bus, router
        self.streams, self.metrics, self.spawn = streams, metrics, spawn
        self.admission = Admission(config.max_inflight, config.max_queued, config.queue_timeout_s)
        self.draining = False
        self.routes: OpenAIRoutes | None = None  # set by ``attach``, before ``add_routes``
        self.started_at = time.monotonic()  # requests wait for workers start_timeout_s from it
        self.recent = RecentRequests()
        self.observer = Observer(metrics, self.recent)
        self.served_name = model.served_name  # the workers' (vLLM's first served name)

    @property
    def in_flight(self) -> int:
        """Generation requests being served or queued for a slot."""
        return self.admission.in_flight + self.admission.waiting

    def attach(self, serving: VllmServing) -> None:
        """Serve the OpenAI routes with vLLM's serving objects."""
        self.routes = OpenAIRoutes(serving, self.admit)

    def add_routes(self, app: web.Application) -> None:
        routes = self.routes
        assert routes is not None, "attach vLLM's serving layer first"
        routes.add_routes(app)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        document = openapi_doc.handler(
            routes,
            routes.served_names(),
            secured=bool(self.config.api_keys),
            max_body_bytes=self.config.max_body_bytes,
        )
        app.router.add_get("/openapi.json", document)
        dashboard.add_routes(app, self.recent, self.dashboard_counters)
        app.middlewares.append(self.middleware)
        if self.config.allowed_origins:
            cors.install(app, self.config.allowed_origins)

    # ---- cross-cutting: auth, OpenAI error bodies, request counts ---------------------------
    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        status = 500
        try:
            if request.path.startswith("/v1/") and self.config.api_keys:
                self._authorize(request)
            if request.path == "/v1/models" and (missing := self.missing()):
                # as /ready: `vllm serve` lists its model only once its engine is up
                raise ApiError(503, "not ready: " + "; ".join(missing), type_="service_unavailable")
            response = await handler(request)
            status = response.status
            return response
        except ApiError as exc:
            status = exc.status
            response = json_response(exc.body(), exc.status)
            if exc.retry_after_s is not None:
                response.headers["Retry-After"] = str(exc.retry_after_s)
            return response
        except web.HTTPException as exc:  # unknown route (404), method (405), too large (413)
            status = exc.status
            if exc.status == 413:
                message = f"request body too large (limit {self.config.max_body_bytes} bytes)"
            else:
                message = exc.reason
            return json_response(error_body(message, "invalid_request_error"), exc.status)
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # client closed the connection
            raise
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            body = error_body("internal server error", "internal_error", code=500)
            return json_response(body, 500)
        finally:
            path = request.path if request.path in ROUTES else "other"
            if path != "other" or status >= 400:
                self.metrics.requests.labels(path, str(status)).inc()

    def _authorize(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip().encode()
        if scheme.lower() == "bearer" and token:
            matches = [hmac.compare_digest(token, key.encode()) for key in self.config.api_keys]
            if any(matches):
                return
        raise ApiError(
            401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key"
        )

    # ---- plain endpoints -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok", "gateway_id": self.config.gateway_id})

    def missing(self) -> list[str]:
        """What keeps the gateway from serving (``/ready`` and ``/v1/models`` answer 503 on it):
        a required role without a live worker, the bus, draining."""
        counts = self.router.registry.counts()
        roles = self.config.required_roles
        missing = [f"no live {role.value} worker" for role in roles if counts[role.value] == 0]
        if not self.bus.is_connected:
            missing.append("not connected to NATS")
        if self.draining:
            missing.append("gateway is shutting down")
        return missing

    async def wait_for_workers(self) -> None:
        """While workers start, hold a request until a worker of each required role has
        registered (up to ``start_timeout_s`` from the gateway's start), then 503 saying which
        never did. Once one has, a role without a live worker is routing's (503 or LOCAL)."""
        registry, timeout_s = self.router.registry, self.config.start_timeout_s
        for role in self.config.required_roles:
            if registry.seen(role):
                continue
            left_s = max(0.0, self.started_at + timeout_s - time.monotonic())
            with _tracer.start_as_current_span("gateway.wait_for_workers") as span:
                span.set_attribute("kvpush.role", role.value)
                try:
                    await asyncio.wait_for(registry.wait_for(role), left_s)
                except TimeoutError:
                    raise ApiError(
                        503,
                        f"no {role.value} worker has registered in the {timeout_s:g} s since the"
                        " gateway started: are the workers running? (/ready lists what is"
                        " missing)",
                        type_="service_unavailable",
                        code="workers_not_ready",
                    ) from None

    async def ready(self, request: web.Request) -> web.Response:
        counts = self.router.registry.counts()
        missing = self.missing()
        body = {
            "ready": not missing,
            "missing": missing,
            "workers": counts,
            "gateway_id": self.config.gateway_id,
            "model": self.model.served_name,
        }
        return json_response(body, 503 if missing else 200)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def dashboard_counters(self) -> dict[str, float]:
        quantiles = self.recent.ttft_quantiles(0.5, 0.99)
        workers = self.router.registry.counts()
        counts = self.observer.counts
        return {
            "in_flight": float(self.in_flight),
            "served": float(counts["ok"]),
            "failed": float(counts["failed"]),
            "ttft_p50_ms": quantiles[0.5] if quantiles[0.5] is not None else float("nan"),
            "ttft_p99_ms": quantiles[0.99] if quantiles[0.99] is not None else float("nan"),
            "prefill_workers": float(workers.get("prefill", 0)),
            "decode_workers": float(workers.get("decode", 0)),
            "kv_fallbacks": float(counts["kv_failed"]),
        }

    # ---- generation ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admit(self, operation: str) -> AsyncIterator[Span]:
        """A generation request's way in: 503 while draining, a slot (queued; 429/503 past the
        bounds), the in-flight gauge, and its ``gateway.request`` span for the body."""
        if self.draining:
            raise ApiError(503, "the gateway is shutting down", type_="service_unavailable")
        async with self.admission.slot():
            self.metrics.in_flight.inc()
            try:
                attributes = {"gen_ai.operation.name": operation, "gen_ai.system": "kvpush"}
                with _tracer.start_as_current_span(
                    "gateway.request", kind=SpanKind.SERVER, attributes=attributes
                ) as span:
                    await self.wait_for_workers()
                    yield span
            finally:
                self.metrics.in_flight.dec()

    async def abort(self, route: Route, transfer_id: str, reason: str, *, decode: bool) -> None:
        message = Abort(transfer_id=transfer_id, sender=self.config.gateway_id, reason=reason)
        targets = [route.prefill_id] if route.prefill_epoch is not None else []
        targets += [route.decode_id] if decode else []
        for worker in targets:
            try:
                await self.bus.publish(subjects.abort(worker), message)
            except Exception as exc:
                log.warning("abort of %s to %s not sent: %r", transfer_id, worker, exc)
