"""``kvpush up``'s configuration: ``UpConfig`` and its settings table (flags, ``KVPUSH_*``
variables), read through ``kvpush.services.settings`` like every other service's.

Threading model: none (values).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from kvpush.schemas.messages import TransferMode, WorkerRole
from kvpush.services import settings
from kvpush.services.gateway.config import SETTINGS as GATEWAY_SETTINGS
from kvpush.services.settings import ConfigError, Setting
from kvpush.services.workers.flags import SETTINGS as WORKER_SETTINGS

GATEWAY = {row.name: row for row in GATEWAY_SETTINGS}  # rows up shares with the gateway
WORKER = {row.name: row for row in WORKER_SETTINGS}  # ... and with every worker
# the worker settings up takes and hands to every worker as given
PASSED_TO_WORKERS = (
    "load_format",
    "dtype",
    "engine_core",
    "enforce_eager",
    "max_inflight",
    "max_num_seqs",
    "reasoning_parser",
    "kv_checksum",
    "serial_prefill_tokens",
)


@dataclasses.dataclass(frozen=True)
class UpConfig:
    nats_url: str | None = None  # None: start an embedded nats-server
    model_dir: str | None = None  # None: the cached tiny model
    prefill: int = 1
    decode: int = 1
    tp: int = 1  # tensor-parallel ranks of every worker
    prefill_tp: int | None = None  # None: tp
    decode_tp: int | None = None  # None: tp
    device: str = "auto"  # passed to every worker (see kvpush prefill --help)
    gpus: str = "0"  # cuda: the GPUs the workers take in turn, e.g. "0,1"
    gpu_memory_utilization: float | None = None  # None: 0.85 split between a GPU's engines
    prefill_gpu_memory_utilization: float | None = None  # None: gpu_memory_utilization's
    decode_gpu_memory_utilization: float | None = None  # None: gpu_memory_utilization's
    mps: str = "off"  # cuda: "on": the engines run as clients of a private MPS daemon (mps.py)
    load_format: str | None = None
    dtype: str | None = None
    engine_core: str | None = None  # every worker's (see kvpush prefill --help)
    enforce_eager: str | None = None  # every worker's
    host: str = "127.0.0.1"
    port: int = 8000
    mode: TransferMode = TransferMode.PUSH
    first_token: WorkerRole = WorkerRole.PREFILL
    max_inflight: int | None = None
    max_num_seqs: int | None = None
    local_threshold: int | None = None
    routing: str | None = None  # the gateway's --routing (its default: routed)
    vllm_args: tuple[str, ...] = ()  # the gateway's `vllm serve` flags (its serving layer)
    engine_args: tuple[str, ...] = ()  # every worker's engine flags (`vllm serve`'s)
    prefill_engine_args: tuple[str, ...] = ()  # ... and those of one role's engines, after them
    decode_engine_args: tuple[str, ...] = ()
    reasoning_parser: str | None = None  # every worker's engine and the gateway's serving layer
    kv_checksum: str | None = None  # every worker's (see kvpush prefill --help)
    serial_prefill_tokens: int | None = None  # every worker's (see kvpush decode --help)
    trace_file: str | None = None
    log_dir: str = str(Path.home() / ".cache" / "kvpush" / "logs")
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 45.0

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ConfigError("--prefill must be >= 0 and --decode >= 1")
        if min(self.tp, self.prefill_tp or 1, self.decode_tp or 1) < 1:
            raise ConfigError("--tp, --prefill-tp and --decode-tp must be >= 1")
        from kvpush.services.workers.config import resolve_device

        self.check_gpu_plan(resolve_device(self.device) == "cuda")
        small, big = sorted((self.tp_of("prefill"), self.tp_of("decode")))
        if big % small:
            raise ConfigError(
                f"--prefill-tp {self.tp_of('prefill')} and --decode-tp {self.tp_of('decode')}:"
                " one must divide the other (KV heads are split or merged between them)"
            )

    def check_gpu_plan(self, cuda: bool) -> None:
        """On CUDA: one GPU per worker (TP 1), and the engines sharing a GPU fit in it."""
        if not cuda:
            return
        if max(self.tp_of("prefill"), self.tp_of("decode")) > 1:
            raise ConfigError("--tp > 1 on CUDA is not supported yet: a worker runs on one GPU")
        gpus = self.gpu_list()
        if not gpus:
            raise ConfigError("--gpus needs at least one GPU index, e.g. 0 or 0,1")
        for gpu, shares in self._shares_by_gpu().items():
            if sum(share for _, share in shares) > 0.95 or min(s for _, s in shares) <= 0:
                plan = " + ".join(f"{role} {share:g}" for role, share in shares)
                raise ConfigError(
                    f"GPU {gpu}'s engines take {plan} of its memory: over the GPU, or nothing"
                    " left for one (--gpu-memory-utilization,"
                    " --prefill-/--decode-gpu-memory-utilization)"
                )

    def roles(self) -> list[str]:
        """Each worker's role, in the order ``up`` starts them (and deals out the GPUs)."""
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    def gpu_of(self, n: int) -> int:
        """The GPU worker ``n`` (``roles`` order) runs on: ``--gpus`` dealt out in turn."""
        gpus = self.gpu_list() or [0]
        return gpus[n % len(gpus)]

    def _shares_by_gpu(self) -> dict[int, list[tuple[str, float]]]:
        by_gpu: dict[int, list[tuple[str, float]]] = {}
        for n, role in enumerate(self.roles()):
            by_gpu.setdefault(self.gpu_of(n), []).append((role, self.gpu_share(n)))
        return by_gpu

    def _given_share(self, role: str) -> float | None:
        own = (
            self.prefill_gpu_memory_utilization
            if role == "prefill"
            else self.decode_gpu_memory_utilization
        )
        return own or self.gpu_memory_utilization

    def gpu_share(self, n: int) -> float:
        """Worker ``n``'s share of its GPU's memory (``roles`` order): its role's, else
        --gpu-memory-utilization, else what is left of 0.85 on its GPU after the shares given
        there, split between the GPU's other engines with a decode engine counted twice (D holds
        every running answer's KV; P a prompt's only until it is pushed)."""
        roles = self.roles()
        given = self._given_share(roles[n])
        if given:
            return given
        gpu = self.gpu_of(n)
        neighbours = [r for k, r in enumerate(roles) if self.gpu_of(k) == gpu]  # on its GPU
        left = 0.85 - sum(self._given_share(r) or 0.0 for r in neighbours)
        weight = {"prefill": 1, "decode": 2}
        free = sum(weight[r] for r in neighbours if not self._given_share(r))
        return round(max(0.0, left) * weight[roles[n]] / free, 3)

    def gpu_list(self) -> list[int]:
        try:
            return [int(g) for g in self.gpus.split(",") if g.strip()]
        except ValueError:
            raise ConfigError(f"--gpus takes indices like 0 or 0,1, not {self.gpus!r}") from None

    def tp_of(self, role: str) -> int:
        """Tensor-parallel ranks of a ``prefill`` or ``decode`` worker."""
        own = self.prefill_tp if role == "prefill" else self.decode_tp
        return own or self.tp

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> UpConfig:
        """Flags > ``KVPUSH_*`` variables > defaults (``SETTINGS``)."""
        values = settings.read(SETTINGS, args, os.environ if env is None else env)
        for name in ("vllm_args", "engine_args", "prefill_engine_args", "decode_engine_args"):
            if name in values:
                values[name] = tuple(values[name])
        config = cls(**values)
        config.check_engine_args()
        return config

    def engine_args_of(self, role: str) -> tuple[str, ...]:
        """The engine flags of a ``prefill`` or ``decode`` worker: everyone's, then its role's."""
        own = self.prefill_engine_args if role == "prefill" else self.decode_engine_args
        return (*self.engine_args, *own)

    def gateway_flags(self, port: int) -> list[str]:
        """The gateway's flags of this stack (``port``: the one ``up`` bound for it)."""
        flags = ["--host", self.host, "--port", str(port), "--mode", self.mode.value]
        flags += ["--first-token", self.first_token.value]
        # requests sent while the workers start wait for them as long as `up` does
        flags += ["--start-timeout-s", f"{self.start_timeout_s:g}"]
        if self.prefill == 0:  # every prompt computed on D: the gateway is ready without P
            flags += ["--required-roles", "decode"]
        if self.local_threshold is not None:
            flags += ["--local-threshold", str(self.local_threshold)]
        if self.routing is not None:
            flags += ["--routing", str(getattr(self.routing, "value", self.routing))]
        vllm_args = list(self.vllm_args)
        if self.reasoning_parser:
            vllm_args.append(f"--reasoning-parser={self.reasoning_parser}")
        return flags + [f"--vllm-arg={flag}" for flag in vllm_args]

    def check_engine_args(self) -> None:
        """vLLM's parser reads each role's engine flags now, not after the workers start."""
        from kvpush.services.workers.config import engine_core_of
        from kvpush.services.workers.engine_args import parse_engine_args

        engine_core = engine_core_of(self.engine_core or "auto", self.device)
        for role in ("prefill", "decode"):
            parse_engine_args(self.engine_args_of(role), engine_core=engine_core)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "nats_url",
        ("--nats-url", "--nats"),
        str,
        "use this NATS server instead of starting one",
        metavar="URL",
    ),
    WORKER["model_dir"],
    Setting("prefill", ("--prefill",), int, "prefill workers (default 1)", "KVPUSH_UP_PREFILL"),
    Setting("decode", ("--decode",), int, "decode workers (default 1)", "KVPUSH_UP_DECODE"),
    Setting(
        "tp",
        ("--tp", "--tensor-parallel-size"),
        int,
        "tensor-parallel ranks of every worker, P and D alike (default 1); each rank runs in a"
        " process of its own on one of the worker's cores",
        "KVPUSH_UP_TP",
    ),
    Setting(
        "prefill_tp",
        ("--prefill-tp",),
        int,
        "tensor-parallel ranks of the prefill workers (default: --tp); P and D may differ when"
        " one divides the other: the connector splits or merges KV heads between them",
        "KVPUSH_UP_PREFILL_TP",
    ),
    Setting(
        "decode_tp",
        ("--decode-tp",),
        int,
        "tensor-parallel ranks of the decode workers (default: --tp)",
        "KVPUSH_UP_DECODE_TP",
    ),
    WORKER["device"],
    Setting(
        "gpus",
        ("--gpus",),
        str,
        "cuda: GPUs the workers take in turn (default 0: P and D share one GPU)",
        "KVPUSH_UP_GPUS",
        metavar="LIST",
    ),
    Setting(
        "gpu_memory_utilization",
        ("--gpu-memory-utilization",),
        float,
        "cuda: each engine's share of its GPU's memory (default 0.85 split between the"
        " engines on one GPU, a decode engine counted twice: D holds every running answer's KV,"
        " P a prompt's only until it is pushed)",
        "KVPUSH_GPU_MEMORY_UTILIZATION",
        metavar="F",
    ),
    *(
        Setting(
            f"{role}_gpu_memory_utilization",
            (f"--{role}-gpu-memory-utilization",),
            float,
            f"cuda: each {role} engine's share of its GPU's memory, instead of"
            " --gpu-memory-utilization (the engines without one split what is left of 0.85)",
            f"KVPUSH_UP_{role.upper()}_GPU_MEMORY_UTILIZATION",
            metavar="F",
        )
        for role in ("prefill", "decode")
    ),
    Setting(
        "mps",
        ("--mps",),
        str,
        "cuda: on runs the engines as clients of NVIDIA's Multi-Process Service (a daemon of the"
        " stack's own), so the engines sharing a GPU run their kernels side by side instead of"
        " taking turns (default off)",
        "KVPUSH_UP_MPS",
        choices=("on", "off"),
    ),
    *(WORKER[name] for name in PASSED_TO_WORKERS),
    *(GATEWAY[name] for name in ("host", "port", "mode", "first_token")),
    GATEWAY["local_threshold"],
    GATEWAY["routing"],
    GATEWAY["vllm_args"],
    WORKER["engine_args"],
    *(
        Setting(
            f"{role}_engine_args",
            (f"--{role}-engine-arg",),
            str,
            f"a `vllm serve` engine flag for the {role} workers' engines only, after"
            f" --engine-arg (repeatable), e.g. --{role}-engine-arg=--max-num-batched-tokens=16384",
            metavar="FLAG",
            repeat=True,
        )
        for role in ("prefill", "decode")
    ),
    WORKER["trace_file"],
    Setting(
        "log_dir",
        ("--log-dir",),
        str,
        "children's logs (default ~/.cache/kvpush/logs)",
        metavar="DIR",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, SETTINGS)
