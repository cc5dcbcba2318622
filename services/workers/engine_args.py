"""vLLM engine flags passed through to a worker's engine: ``--engine-arg`` (workers and
``kvpush up``, e.g. ``--engine-arg=--max-num-batched-tokens=16384``) carries any ``vllm serve``
engine flag, parsed by vLLM's own ``EngineArgs`` parser, so its spelling, types and errors are
vLLM's. ``parse_engine_args`` turns the flags into ``EngineArgs`` keyword arguments (only those
given); the flags kvpush sets itself are refused with the reason and the kvpush flag to use
instead (``OWNED``).

Threading model: none (pure functions; the first call imports vLLM's argument parser, seconds).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvpush.services.settings import ConfigError

# EngineArgs fields kvpush sets: the reason, and what to use instead.
OWNED: dict[str, str] = {
    "kv_transfer_config": "kvpush makes the KV connector's config (push or pull over its bus)",
    "scheduler_cls": "kvpush's scheduler reports P's first token from the engine core",
    "worker_extension_cls": "kvpush's worker extension answers the worker's rank questions",
    "disable_log_stats": "kvpush reads the pool's free blocks from the engine's stats",
    "kv_events_config": "kvpush reads the engine's KV cache events (--kv-events)",
    "model": "use kvpush's --model",
    "served_model_name": "use kvpush's --served-model-name",
    "max_model_len": "use kvpush's --max-model-len (the gateway checks prompts against it)",
    "max_num_seqs": "use kvpush's --max-num-seqs (admission is sized from it)",
    "tensor_parallel_size": "use kvpush's --tp (the connector registers every rank)",
    "distributed_executor_backend": "use kvpush's --executor",
    "data_parallel_size": "a worker runs one engine: start more workers instead",
    "pipeline_parallel_size": "kvpush's connector moves KV of tensor-parallel ranks only",
    "dtype": "use kvpush's --dtype",
    "load_format": "use kvpush's --load-format",
    "gpu_memory_utilization": "use kvpush's --gpu-memory-utilization",
    "enforce_eager": "use kvpush's --enforce-eager",
    "reasoning_parser": "use kvpush's --reasoning-parser",
}


def parse_engine_args(flags: Sequence[str], *, engine_core: str = "process") -> dict[str, Any]:
    """The ``EngineArgs`` keyword arguments that ``flags`` give (only those: vLLM's defaults
    stay vLLM's). Each item is one flag, with its value after ``=`` or a space (``"-O3"``,
    ``"--kv-cache-dtype fp8"``, ``"--max-num-batched-tokens=16384"``). Raises ``ConfigError``
    for a flag vLLM does not know, a value it does not take, or a flag in ``OWNED``."""
    if not flags:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        """vLLM's parser, raising ``ConfigError`` instead of printing its usage and exiting."""

        def error(self, message: str) -> Any:  # type: ignore[override]
            raise ConfigError(f"--engine-arg: {message}")

    parser = Parser(prog="--engine-arg", add_help=False)
    EngineArgs.add_cli_args(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS  # only what was given comes back
    argv = [word for item in flags for word in _words(item)]
    given = vars(parser.parse_args(argv))
    for name in given:
        if name in OWNED:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"--engine-arg {flag}: kvpush sets it ({OWNED[name]})")
    if engine_core == "thread" and given.get("async_scheduling"):
        raise ConfigError(
            "--engine-arg --async-scheduling: the thread engine core steps synchronously;"
            " use --engine-core process"
        )
    return given


def _words(item: str) -> list[str]:
    """``"--flag=value"`` stays one word (a JSON value keeps its spaces and quotes); ``"--flag
    value"`` is the flag and its value."""
    head, _, rest = item.strip().partition(" ")
    if "=" in head or not rest.strip():
        return [item.strip()]
    return [head, rest.strip()]
