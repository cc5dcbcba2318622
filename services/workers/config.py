"""Worker configuration: the one place where CLI flags and environment variables become a
``WorkerConfig`` (flag > ``KVPUSH_*`` environment variable > default).

Also owns the defaults every entry point shares: the worker id (``<role>-<host>-<pid>``), the
served model (the tiny model, built once into ``models.default_model_cache_dir()``) and the
served model name (the model's recipe name, else its folder name).

Threading model: none (values and pure functions; ``default_model_dir`` may build a model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvpush.connector import VLLM_CONNECTOR_CLASS, VLLM_CONNECTOR_MODULE
from kvpush.schemas import subjects
from kvpush.schemas.messages import WorkerRole
from kvpush.services import models
from kvpush.services.workers.engine import EngineConfig

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything one prefill or decode worker runs with."""

    role: WorkerRole
    worker_id: str
    model_dir: str
    model_name: str
    nats_url: str = DEFAULT_NATS_URL
    cpu_cores: list[int] | None = None
    max_inflight: int = 64  # accepted requests at once; past it: refused at once
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    heartbeat_s: float = 1.0
    registry_ttl_s: float = 5.0  # the registry bucket's TTL (set by whoever creates it)
    prefill_lease_s: float = 3.0  # decode: a prefill worker silent this long is probed
    registry_replicas: int = 1  # ... and its JetStream replicas (3 on a 3-server cluster)
    drain_grace_s: float = 0.5  # keep taking requests this long after the draining beat
    drain_timeout_s: float = 30.0  # then in-flight requests are aborted
    transfer_timeout_s: float = 30.0  # a transfer without a deadline gets this long
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: any free port (it is advertised in heartbeats)
    advertise_host: str | None = None
    fault_layer_delay_ms: float = 0.0  # fault injection (tests, soak): a slow prefill
    log_level: str = "INFO"
    trace_file: str | None = None  # JSON-lines span file (also: OTEL_* variables)

    def engine_config(self) -> EngineConfig:
        extra: dict[str, Any] = {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "nats_url": self.nats_url,
            "model_id": self.model_name,
            "side_channel_host": self.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "transfer_timeout_s": self.transfer_timeout_s,
        }
        if self.fault_layer_delay_ms:
            extra["fault_layer_delay_ms"] = self.fault_layer_delay_ms
        if self.advertise_host:
            extra["advertise_host"] = self.advertise_host
        prefill = self.role is WorkerRole.PREFILL
        return EngineConfig(
            model_dir=self.model_dir,
            max_model_len=self.max_model_len,
            kv_cache_gib=self.kv_cache_gib,
            max_num_seqs=self.max_inflight,
            cpu_cores=self.cpu_cores,
            kv_transfer_config={
                "kv_connector": VLLM_CONNECTOR_CLASS,
                "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
                "kv_role": "kv_producer" if prefill else "kv_consumer",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            },
        )


def default_worker_id(role: WorkerRole) -> str:
    raw = f"{WorkerRole(role).value}-{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_-]+", "-", raw)[:64]


def default_model_dir(progress: Callable[[str], None] | None = None) -> Path:
    """The tiny model in the model cache, built on first use (idempotent, concurrency-safe)."""
    return models.build_model(
        models.TINY, models.default_model_cache_dir() / models.TINY.name, progress
    )


def model_name_of(model_dir: str | Path) -> str:
    recipe = (models.read_stamp(model_dir) or {}).get("recipe") or {}
    return str(recipe.get("name") or Path(model_dir).resolve().name)


def parse_cpus(text: str) -> list[int]:
    """``"0"``, ``"0,2"`` or ``"0-3"`` -> sorted core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return sorted(cores)


# (flag dest, environment variable, type) of every worker setting a flag can override
_SETTINGS: tuple[tuple[str, str, Callable[[str], Any]], ...] = (
    ("worker_id", "KVPUSH_WORKER_ID", str),
    ("nats_url", "KVPUSH_NATS_URL", str),
    ("model_dir", "KVPUSH_MODEL", str),
    ("model_name", "KVPUSH_SERVED_MODEL_NAME", str),
    ("cpu_cores", "KVPUSH_CPUS", parse_cpus),
    ("max_inflight", "KVPUSH_WORKER_MAX_INFLIGHT", int),
    ("max_model_len", "KVPUSH_MAX_MODEL_LEN", int),
    ("kv_cache_gib", "KVPUSH_KV_CACHE_GIB", int),
    ("heartbeat_s", "KVPUSH_HEARTBEAT_S", float),
    ("drain_timeout_s", "KVPUSH_DRAIN_TIMEOUT_S", float),
    ("transfer_timeout_s", "KVPUSH_TRANSFER_TIMEOUT_S", float),
    ("side_channel_host", "KVPUSH_SIDE_CHANNEL_HOST", str),
    ("side_channel_port", "KVPUSH_SIDE_CHANNEL_PORT", int),
    ("registry_replicas", "KVPUSH_REGISTRY_REPLICAS", int),
    ("prefill_lease_s", "KVPUSH_PREFILL_LEASE_S", float),
    ("fault_layer_delay_ms", "KVPUSH_FAULT_LAYER_DELAY_MS", float),  # no flag: tests only
    ("advertise_host", "KVPUSH_ADVERTISE_HOST", str),
    ("log_level", "KVPUSH_LOG_LEVEL", str),
    ("trace_file", "KVPUSH_TRACE_FILE", str),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpush prefill`` and ``kvpush decode`` (each has a KVPUSH_* variable)."""
    add = parser.add_argument
    add(
        "--id",
        dest="worker_id",
        metavar="ID",
        help="worker id, [A-Za-z0-9_-] (KVPUSH_WORKER_ID; default <role>-<hostname>-<pid>)",
    )
    add(
        "--nats",
        "--nats-url",
        dest="nats_url",
        metavar="URL",
        help=f"NATS server(s), comma separated (KVPUSH_NATS_URL; default {DEFAULT_NATS_URL})",
    )
    add(
        "--model",
        dest="model_dir",
        metavar="DIR",
        help="model folder (KVPUSH_MODEL; default: "
        "the tiny model, built once into the kvpush cache)",
    )
    add(
        "--served-model-name",
        dest="model_name",
        metavar="NAME",
        help="model name clients "
        "ask for (KVPUSH_SERVED_MODEL_NAME; default: the model's recipe name or folder name)",
    )
    add(
        "--cpus",
        dest="cpu_cores",
        type=parse_cpus,
        metavar="LIST",
        help="pin the engine to these cores, e.g. 0 or 0-3 (KVPUSH_CPUS; default: not pinned)",
    )
    add(
        "--max-inflight",
        dest="max_inflight",
        type=int,
        metavar="N",
        help="requests at once; more are refused at once (KVPUSH_WORKER_MAX_INFLIGHT; default 64)",
    )
    add(
        "--max-model-len",
        dest="max_model_len",
        type=int,
        metavar="N",
        help="context length (KVPUSH_MAX_MODEL_LEN; default: the model's, else 4096)",
    )
    add(
        "--kv-cache-gib",
        dest="kv_cache_gib",
        type=int,
        metavar="GIB",
        help="KV cache size on CPU (KVPUSH_KV_CACHE_GIB; default 1)",
    )
    add(
        "--heartbeat-s",
        dest="heartbeat_s",
        type=float,
        metavar="S",
        help="heartbeat period (KVPUSH_HEARTBEAT_S; default 1)",
    )
    add(
        "--drain-timeout-s",
        dest="drain_timeout_s",
        type=float,
        metavar="S",
        help="on SIGTERM, abort what is still running after this long (default 30)",
    )
    add(
        "--transfer-timeout-s",
        dest="transfer_timeout_s",
        type=float,
        metavar="S",
        help="KV transfer timeout for requests without a deadline (default 30)",
    )
    add(
        "--side-channel-host",
        dest="side_channel_host",
        metavar="HOST",
        help="address the connector's side channel binds (default 127.0.0.1)",
    )
    add(
        "--side-channel-port",
        dest="side_channel_port",
        type=int,
        metavar="PORT",
        help="port of the side channel (default 0: any free port; fix it for firewalls/k8s)",
    )
    add(
        "--advertise-host",
        dest="advertise_host",
        metavar="HOST",
        help="address peers reach the side channel at (default: the bound one)",
    )
    add("--log-level", dest="log_level", metavar="LEVEL", help="DEBUG, INFO, WARNING (INFO)")
    add(
        "--trace-file",
        dest="trace_file",
        metavar="PATH",
        help="append finished spans to PATH as JSON lines (read them with `kvpush ttft`); "
        "OTEL_EXPORTER_OTLP_ENDPOINT etc. send them to a collector instead or as well",
    )


def config_from_args(
    role: WorkerRole, args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> WorkerConfig:
    """Build the worker's config: a flag wins over its environment variable, which wins over
    the default. Builds the tiny model when no model is given."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name, variable, cast in _SETTINGS:
        value = getattr(args, name, None)
        if value is None and env.get(variable):
            try:
                value = cast(env[variable])
            except ValueError as exc:
                raise SystemExit(f"invalid {variable}={env[variable]!r}: {exc}") from None
        if value is not None:
            values[name] = value
    values["worker_id"] = values.get("worker_id") or default_worker_id(role)
    try:
        subjects.check_id(values["worker_id"])
    except subjects.SubjectError as exc:
        raise SystemExit(str(exc)) from None
    values["model_dir"] = str(Path(values.get("model_dir") or default_model_dir()).resolve())
    values.setdefault("model_name", model_name_of(values["model_dir"]))
    if "max_model_len" not in values:
        recipe = (models.read_stamp(values["model_dir"]) or {}).get("recipe") or {}
        values["max_model_len"] = int(recipe.get("max_context") or 4096)
    return WorkerConfig(role=WorkerRole(role), **values)
