"""The gateway's configuration: ``GatewayConfig``, its flags and environment variables.

``GatewayConfig.from_args`` is the one place flags and environment variables become config
(flag > ``KVPUSH_*`` env var > default); ``add_arguments`` declares the flags from the same
table (``_OPTIONS``: flag, env var, type, help). ``ConfigError`` says which setting is unusable
and why (the CLI exits 2 with it).

Threading model: none (values and pure functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpush.connector import BusConfig
from kvpush.schemas import subjects
from kvpush.schemas.messages import TransferMode


class ConfigError(ValueError):
    """The gateway's flags, environment or model folder are unusable; says which and why."""


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
