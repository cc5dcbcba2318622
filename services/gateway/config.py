"""The gateway's configuration: ``GatewayConfig``, its flags and environment variables.

``GatewayConfig.from_args`` is the one place flags and environment variables become config
(flag > ``KVPUSH_*`` env var > default), through the settings table ``SETTINGS`` and
``kvpush.services.settings`` (the one mechanism of every service). ``ConfigError`` says which
setting is unusable and why (the CLI exits 2 with it).

Threading model: none (values and pure functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from kvpush.connector import DEFAULT_NATS_URL
from kvpush.schemas import subjects
from kvpush.schemas.messages import TransferMode, WorkerRole
from kvpush.services import settings
from kvpush.services.gateway.prefix_index import DEFAULT_MAX_BLOCKS
from kvpush.services.gateway.routing import RoutingPolicy
from kvpush.services.settings import ConfigError, Setting


def _roles(text: str) -> tuple[WorkerRole, ...]:
    """``"prefill,decode"`` -> the roles, in that order."""
    return tuple(WorkerRole(part.strip()) for part in text.split(",") if part.strip())


SETTINGS: tuple[Setting, ...] = (
    Setting("model", ("--model",), str, "model folder: tokenizer + config.json", metavar="DIR"),
    Setting(
        "served_model_name",
        ("--served-model-name",),
        str,
        "model name clients send, or several as a comma list (the gateway answers to"
        " each; the first is the workers' --served-model-name); default: the stamp's name,"
        " else the folder's name",
        metavar="NAME",
    ),
    Setting("max_model_len", ("--max-model-len",), int, "context length (default: the model's)"),
    Setting(
        "host",
        ("--host",),
        str,
        "listen address (default 127.0.0.1)",
        "KVPUSH_GATEWAY_HOST",
        metavar="ADDR",
    ),
    Setting(
        "port",
        ("--port",),
        int,
        "listen port (default 8000; 0: any)",
        "KVPUSH_GATEWAY_PORT",
        metavar="PORT",
    ),
    Setting(
        "listen_fd",
        ("--listen-fd",),
        int,
        "serve on this already-listening socket, inherited from a parent that bound"
        " --host/--port (as `kvpush up` does): no race for the port",
        metavar="FD",
    ),
    Setting(
        "nats_url",
        ("--nats-url",),
        str,
        f"NATS server URL(s), comma separated (default {DEFAULT_NATS_URL})",
        metavar="URL",
    ),
    Setting(
        "gateway_id",
        ("--gateway-id",),
        str,
        "this gateway's id (default gw-<random>)",
        metavar="ID",
    ),
    Setting(
        "mode",
        ("--mode",),
        TransferMode,
        "KV transfer mode (default push)",
        choices=("push", "pull"),
    ),
    Setting(
        "routing",
        ("--routing",),
        RoutingPolicy,
        "how requests are placed: routed (default: the cheapest of D-local prefill and the"
        " --mode transfer by estimated TTFT, from each worker's prefix-cache hit, load and"
        " measured rates) or least-loaded (the least-loaded P and D, --local-threshold decides"
        " the mode)",
        choices=tuple(policy.value for policy in RoutingPolicy),
    ),
    Setting(
        "local_threshold",
        ("--local-threshold",),
        int,
        "prompts shorter than this many tokens are served by D alone (default 256; 0: never);"
        " with --routing routed only until the cost model has measurements (cold start, when an"
        " idle D also serves a longer prompt alone), except that 0 still means never (unless a"
        " request asks for local)",
    ),
    Setting(
        "first_token",
        ("--first-token",),
        WorkerRole,
        "who samples the answer's first token in push and pull: prefill (default: its prefill"
        " samples it anyway and decode continues from it, one decode step less before the"
        " first token) or decode (vLLM's way: decode samples it again once the KV landed)",
        choices=("prefill", "decode"),
    ),
    Setting(
        "max_inflight",
        ("--max-inflight",),
        int,
        "generation requests served at once; more wait in the queue (default 256)",
        "KVPUSH_GATEWAY_MAX_INFLIGHT",
    ),
    Setting(
        "max_queued",
        ("--max-queued",),
        int,
        "requests waiting for one of --max-inflight's slots, first come first served; past it:"
        " 429 with Retry-After (default 4096; 0: refuse at once)",
        "KVPUSH_GATEWAY_MAX_QUEUED",
    ),
    Setting(
        "queue_timeout_s",
        ("--queue-timeout-s",),
        float,
        "a queued request gets 503 with Retry-After after waiting this long (default 600)",
    ),
    Setting(
        "start_timeout_s",
        ("--start-timeout-s",),
        float,
        "while workers start: a request that finds no worker of a --required-roles role waits"
        " for one this long from the gateway's start, then gets 503 saying which role never"
        " registered (default 600: a cold engine compiles for minutes)",
        "KVPUSH_GATEWAY_START_TIMEOUT_S",
    ),
    Setting(
        "required_roles",
        ("--required-roles",),
        _roles,
        "the worker roles the gateway needs a live worker of to be ready (/ready, /v1/models)"
        " and that requests wait for at start (default prefill,decode; decode alone for a"
        " deployment without prefill workers: every prompt computed on D)",
        metavar="ROLES",
    ),
    Setting(
        "request_timeout_s",
        ("--request-timeout-s",),
        float,
        "seconds from a request's start to its first token (the KV transfer's deadline too);"
        " past it: 504 (default 300)",
    ),
    Setting(
        "stream_idle_timeout_s",
        ("--stream-idle-timeout-s",),
        float,
        "after the first token, the longest wait for the next one; past it: 504 (default 300;"
        " an answer has no total deadline)",
    ),
    Setting(
        "api_keys",
        ("--api-key",),
        str,
        "accepted Bearer key (repeatable; env: comma list); none: no auth",
        "KVPUSH_API_KEYS",
        metavar="KEY",
        repeat=True,
    ),
    Setting(
        "worker_lease_s",
        ("--worker-lease-s",),
        float,
        "a worker silent this long is gone, where its heartbeats state no lease (default 1.5)",
    ),
    Setting(
        "prefix_index_max_blocks",
        ("--prefix-index-max-blocks",),
        int,
        "the prefix index's bound: (worker, block) entries of all workers' prefix caches it"
        " holds (default 500000, about 140 bytes each); past it the least recently stored or"
        " matched entries go",
        metavar="N",
    ),
    Setting(
        "migration_limit",
        ("--migration-limit",),
        int,
        "how many times one request moves to other workers when its own die (a decode worker:"
        " continuing from its prompt and the tokens already sent; default 3; 0: never)",
    ),
    Setting(
        "max_body_bytes",
        ("--max-body-bytes",),
        int,
        "largest request body (8 MiB)",
        metavar="BYTES",
    ),
    Setting(
        "shutdown_grace_s",
        ("--shutdown-grace-s",),
        float,
        "seconds in-flight requests get on SIGTERM (30)",
    ),
    Setting(
        "allowed_origins",
        ("--allowed-origin",),
        str,
        "a browser origin allowed to call the gateway (CORS), e.g. https://app.example.com, or *"
        " (repeatable; env: comma list; default: none, no CORS headers)",
        "KVPUSH_ALLOWED_ORIGINS",
        metavar="ORIGIN",
        repeat=True,
    ),
    Setting(
        "vllm_args",
        ("--vllm-arg",),
        str,
        "a `vllm serve` flag for vLLM's serving layer in the gateway, e.g."
        " --vllm-arg=--enable-auto-tool-choice --vllm-arg=--tool-call-parser=hermes"
        " (repeatable; env: comma list)",
        "KVPUSH_VLLM_ARGS",
        metavar="FLAG",
        repeat=True,
    ),
    Setting(
        "trace_file",
        ("--trace-file",),
        str,
        "append finished spans to this file as JSON lines (read with `kvpush ttft`)",
        metavar="PATH",
    ),
)


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # model folder (tokenizer, config.json, optional kvpush-model.json stamp)
    served_model_name: str | None = None  # default: the stamp's recipe name, else folder name
    max_model_len: int | None = None  # default: stamp max_context / config.json
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    listen_fd: int | None = None  # an inherited listening socket: served instead of host:port
    nats_url: str = DEFAULT_NATS_URL
    gateway_id: str = dataclasses.field(default_factory=lambda: f"gw-{secrets.token_hex(4)}")
    mode: TransferMode = TransferMode.PUSH  # deployment default: push or pull
    routing: RoutingPolicy = RoutingPolicy.ROUTED  # routed (cost model) or least-loaded
    local_threshold: int = 256  # prompts shorter than this go LOCAL (routed: while cold); 0: never
    first_token: WorkerRole = WorkerRole.PREFILL  # who samples it in push and pull
    max_inflight: int = 256  # generation requests served at once
    max_queued: int = 4096  # ... and waiting for a slot (past it: 429)
    queue_timeout_s: float = 600.0  # the longest wait for a slot (then 503)
    request_timeout_s: float = 300.0  # start -> first token
    start_timeout_s: float = 600.0  # requests wait this long from start for the first workers
    required_roles: tuple[WorkerRole, ...] = (WorkerRole.PREFILL, WorkerRole.DECODE)
    stream_idle_timeout_s: float = 300.0  # first token on: the longest gap between tokens
    api_keys: tuple[str, ...] = ()
    worker_lease_s: float = 1.5  # the lease of workers whose heartbeats state none
    prefix_index_max_blocks: int = DEFAULT_MAX_BLOCKS  # (worker, block) entries, all workers
    migration_limit: int = 3  # moves of one request to another decode worker
    max_body_bytes: int = 8 * 1024 * 1024
    stream_buffer_chunks: int = 4096  # per request; beyond it the request fails
    shutdown_grace_s: float = 30.0
    trace_file: str | None = None  # JSON-lines span file (also: OTEL_* variables)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed ("*": any)
    vllm_args: tuple[str, ...] = ()  # `vllm serve` flags for vLLM's serving layer

    def __post_init__(self) -> None:
        subjects.check_id(self.gateway_id)
        if self.mode not in (TransferMode.PUSH, TransferMode.PULL):
            raise ConfigError("--mode must be push or pull")
        positive = (
            "max_inflight",
            "request_timeout_s",
            "worker_lease_s",
            "max_body_bytes",
            "prefix_index_max_blocks",
        )
        timeouts = ("queue_timeout_s", "stream_idle_timeout_s", "start_timeout_s")
        for name in (*positive, *timeouts, "stream_buffer_chunks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if WorkerRole.DECODE not in self.required_roles:
            raise ConfigError("--required-roles must include decode: decode answers every request")
        if self.max_queued < 0 or self.migration_limit < 0:
            raise ConfigError("max_queued and migration_limit must be >= 0")
        if self.local_threshold < 0 or not 0 <= self.port <= 65535:
            raise ConfigError("local_threshold must be >= 0 and port within 0..65535")
        if self.listen_fd is not None and self.listen_fd < 0:
            raise ConfigError(f"--listen-fd must be >= 0, not {self.listen_fd}")

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Flags (``add_arguments``) > environment (``KVPUSH_*``) > defaults."""
        values = settings.read(SETTINGS, args, os.environ if environ is None else environ)
        if "model" not in values:
            raise ConfigError("--model DIR (or KVPUSH_MODEL) is required")
        for name in ("api_keys", "vllm_args", "allowed_origins"):
            if name in values:
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except ValueError as exc:  # includes subjects.SubjectError for a bad gateway id
            raise ConfigError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags (all optional here; ``from_args`` applies env and defaults)."""
    settings.add_arguments(parser, SETTINGS)
