"""One child process of ``kvpush up`` (a worker or the gateway): how it starts (its own
session, its log file, SIGTERM should ``up`` die: PR_SET_PDEATHSIG; the listening sockets
``up`` holds for it, ``pass_fds``: the same ones at every start), whether it exited, the
tail of its log, and what a starting worker's engine is doing (``phase``: from the last vLLM
step its log names), which ``up`` prints while the stack starts; and which GPUs' engines may
start at once (``gpus_started_together``).

Threading model: none of its own; called from ``up``'s asyncio loop (short file reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import time
from pathlib import Path

from kvpush.services.natsd import die_with_parent
from kvpush.services.settings import ConfigError
from kvpush.services.workers import config as worker_config

# what a worker's log says its engine is doing while it starts: (a line's text, the phase)
ENGINE_PHASES = (
    ("importing vllm", "importing vLLM"),
    ("waiting for its GPU", "waiting for its GPU"),
    ("starting the engine", "starting the engine"),
    ("Loading model", "loading weights"),
    ("Model loading took", "profiling memory"),
    ("Compiling a graph", "compiling (torch.compile; cached for restarts)"),
    ("Directly load the compiled graph", "loading compiled graphs from the cache"),
    ("torch.compile took", "profiling memory"),
    ("Capturing CUDA graph", "capturing CUDA graphs"),
    ("Graph capturing finished", "warming up"),
    ("init engine", "joining the bus"),
)


@dataclasses.dataclass
class Child:
    """One child process of the stack; ``ready_s`` is set once it is ready."""

    name: str
    argv: list[str]
    log_path: Path
    cores: list[int] | None = None
    gpu: int | None = None  # engines sharing a GPU take it one after another
    proc: subprocess.Popen[bytes] | None = None
    gate: Path | None = None  # a worker's --start-after file: its engine waits for it
    started_at: float = 0.0  # its start, or (gated) when its gate opened: its turn on the GPU
    ready_s: float | None = None
    metrics_url: str = ""  # a worker's vllm:* engine metrics
    restarts: int = 0
    pass_fds: tuple[int, ...] = ()  # listening sockets up holds for it (up_sockets), kept open

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab" if self.restarts else "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
                pass_fds=self.pass_fds,  # every other descriptor of up's is closed in the child
            )
        self.started_at = time.monotonic()

    @property
    def gated(self) -> bool:
        """Its engine still waits for its turn on the GPU."""
        return self.gate is not None and not self.gate.exists()

    def open_gate(self) -> None:
        """Its engine's turn on the GPU (the worker imported vLLM meanwhile)."""
        if self.gate is not None:
            self.gate.touch()
        self.started_at = time.monotonic()

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def phase(self) -> str:
        """What a starting worker is doing, from the last engine step its log names."""
        if self.proc is None:
            return "waiting for its GPU"
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
                text = log.read().decode(errors="replace")
        except OSError:
            return "starting"
        found = [(text.rfind(mark), phase) for mark, phase in ENGINE_PHASES]
        at, phase = max(found)
        return phase if at >= 0 else "starting"

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text)


def gpus_started_together(workers: list[Child]) -> set[int]:
    """The GPUs whose every engine remembers its KV cache size from an earlier start on this
    host (``workers.kv_memory``): they skip vLLM's memory profiling, so they may start at
    once."""
    from kvpush.schemas.messages import WorkerRole
    from kvpush.services.workers import kv_memory

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    known: dict[int, bool] = {}
    for child in workers:
        if child.gpu is None:
            continue
        at = child.argv.index("kvpush.services.cli") + 1
        try:
            args = parser.parse_args(child.argv[at + 1 :])
            config = worker_config.config_from_args(WorkerRole(child.argv[at]), args)
            key = kv_memory.key_of(config.engine_config())
        except (ConfigError, ValueError):
            key = None
        known[child.gpu] = known.get(child.gpu, True) and bool(key and kv_memory.remembered(key))
    return {gpu for gpu, ok in known.items() if ok}
