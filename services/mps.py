"""NVIDIA's Multi-Process Service for the engines that share a GPU (``kvpush up --mps``).

Without it, the GPU time-slices between processes: while D decodes, P's prefill gets about half
of the GPU (on the H200, a 2048-token prefill took 43.2 ms alone and 81.7-100 ms with D decoding
beside it, docs/benchmarks/gpu-serve/engines/). Under MPS the engines' kernels run side by
side on the GPU's SMs, as one process's streams would.

``MpsDaemon`` owns one MPS control daemon of the stack's own: its pipe and log folders are
private (a temporary folder), so it neither needs nor disturbs a host-wide one. ``start``
launches ``nvidia-cuda-mps-control -d`` and returns the environment variables every engine
process must inherit to become its client; ``stop`` asks it to quit (it stops its servers).

Threading model: none of its own (blocking calls, short: the daemon forks and returns).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsError(RuntimeError):
    """MPS could not start (no control binary, or the daemon failed)."""


class MpsDaemon:
    """One private MPS control daemon (module docstring)."""

    def __init__(self, control: str | None = None) -> None:
        self.control = control or shutil.which(CONTROL) or ""
        self.folder = ""

    def env(self) -> dict[str, str]:
        """The variables that make a CUDA process a client of this daemon."""
        folder = Path(self.folder)
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
        }

    def start(self) -> dict[str, str]:
        """Launch the daemon; the clients' environment variables."""
        if not self.control:
            raise MpsError(f"--mps on: {CONTROL} is not on PATH (it comes with the GPU driver)")
        self.folder = tempfile.mkdtemp(prefix="kvpush-mps-")
        env = self.env()
        for folder in env.values():
            Path(folder).mkdir()
        done = self._run("-d")
        if done.returncode != 0:
            self._remove()
            detail = (done.stderr or done.stdout).strip()[-300:]
            raise MpsError(f"{CONTROL} -d failed ({done.returncode}): {detail}")
        return env

    def stop(self) -> None:
        """Ask the daemon to quit (its servers end once their clients have), then forget it."""
        if not self.folder:
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self._run(stdin="quit\n")
        self._remove()

    def _run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """The control program, run as a client of this daemon."""
        env = {**os.environ, **self.env()}
        return subprocess.run(
            [self.control, *args], input=stdin, env=env, capture_output=True, text=True, timeout=30
        )

    def _remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = ""
