"""The systems ``kvpush bench serve`` compares, behind one interface: start, serve, stop.

A ``System`` starts its processes on the machine (same model folder, same cores: prefill on
``ctx.prefill_core``, decode on ``ctx.decode_core``, an aggregated engine on the prefill core)
and returns the base URL of an OpenAI-compatible HTTP endpoint (``POST /v1/completions`` with
``stream: true`` and token-id prompts). The load generator only ever talks to that URL.

- ``KvpushSystem``: ``kvpush up`` in push or pull mode (embedded nats-server, gateway, one P,
  one D, every prompt moved: ``--local-threshold 0``; on a GPU the workers' defaults, each
  engine as ``vllm serve`` runs it, and ``-eager`` rows add ``--enforce-eager``; the
  ``kvpush-push-mps`` row adds ``--mps on``, ``kvpush-push-unchecked`` ``--kv-checksum off``),
  optionally with ``--trace-file`` (spans for ``kvpush ttft``). Every request names its mode
  (``kvpush_mode``, ``request_extra``): the gateway then answers 503 when no prefill worker is
  alive instead of degrading to local mode (``gateway/routing.py``, ``Router.route``), so a
  benchmark point cannot silently measure decode computing the prompt.
- ``KvpushRoutedSystem`` (issue 32's routing benchmark): ``kvpush up --prefill 2 --decode 2``
  (on a GPU ``--decode 1``: 2P1D sharing the one GPU) in push mode under a routing policy,
  ``kvpush-routed`` (``--routing routed``, the default ``--local-threshold``: routed decides
  per request between D-local prefill and the push) and
  ``kvpush-least-loaded`` (``--routing least-loaded``, ``--local-threshold 256``, the old
  default); ``kvpush-routed-1p1d`` is ``kvpush-routed`` as 1P1D (a labelled row for one
  GPU). Their requests name no mode (the policy chooses; some requests are local on
  purpose), so their transfer check is ``none``. The policy reaches the gateway through its
  environment variable ``KVPUSH_ROUTING`` (``kvpush up --routing`` does the same).

``transfer`` says how ``checks.py`` verifies that each request's KV was moved: ``gateway``
(the kvpush gateway's /metrics counters), ``proxy`` (the proxy's ``no_kv_params`` and D's cached
prompt tokens) or ``none`` (one engine: nothing moves).
- vLLM's own peers (``vllm_systems.py``): ``vllm-pull`` (NixlConnector + a sequential proxy),
  ``vllm-push`` (NixlPushConnector, both legs at once) and ``aggregated`` (one vLLM server).

Threading model: asyncio; every system runs its processes as children in their own process
group, killed on ``stop`` (and by PR_SET_PDEATHSIG if the bench itself dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class BenchContext:
    """What every system shares in one bench run."""

    model_dir: Path
    served_name: str
    log_dir: Path
    prefill_core: int = 0
    decode_core: int = 1
    start_timeout_s: float = 600.0
    trace_dir: Path | None = None  # kvpush systems write <name>.jsonl here
    say: object = field(default=print)  # progress lines (callable)
    device: str = "cpu"  # cuda: every engine on ``gpu``, each with ``gpu_memory_utilization``
    gpu: int = 0
    gpu_memory_utilization: float = 0.4
    decode_gpu_memory_utilization: float | None = None  # kvpush's D engines' (None: the above)
    load_format: str = "auto"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StartError(RuntimeError):
    """A system did not come up; the message ends with the tail of its logs."""


class Process:
    """One child process in its own process group, stdout+stderr into ``log``."""

    def __init__(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self

    @property
    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process's whole group (it may have children of its own)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self) -> int | None:
        """Block until the process has exited; its exit code (None: never started)."""
        return None if self.proc is None else self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _die_with_parent() -> None:
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def wait_http_ok(url: str, processes: list[Process], timeout_s: float) -> None:
    """Until ``GET url`` answers 200; StartError when a process exits or time runs out."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            for p in processes:
                if p.exited is not None:
                    raise StartError(f"{p.name} exited ({p.exited}); {p.log}:\n{p.tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.log}\n{p.tail()}" for p in processes)
                raise StartError(f"{url} not ready in {timeout_s:.0f} s\n{tails}")
            await asyncio.sleep(0.5)


async def wait_banner(process: Process, offset: int, timeout_s: float) -> str:
    """The gateway URL ``kvpush up`` names in its banner (``up.BANNER_URL``), read from
    ``process``'s log past ``offset``; StartError when the process exits or time runs out."""
    from kvpush.services.up import BANNER_URL

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), open(process.log, "rb") as log:
            log.seek(offset)
            found = BANNER_URL.search(log.read().decode(errors="replace"))
            if found:
                return found.group(1)
        if process.exited is not None:
            raise StartError(
                f"{process.name} exited ({process.exited}); {process.log}:\n{process.tail()}"
            )
        if time.monotonic() > deadline:
            raise StartError(f"{process.name}: no banner in {timeout_s:.0f} s\n{process.tail()}")
        await asyncio.sleep(0.2)


class System:
    """One system under test; subclasses set ``name`` and implement ``start``."""

    name: ClassVar[str]
    disaggregated: ClassVar[bool] = True
    transfer: ClassVar[str] = "none"  # gateway | proxy | none (see the module docstring)

    def __init__(self) -> None:
        self.processes: list[Process] = []
        self.trace_file: Path | None = None  # kvpush systems: spans of this run
        self.run_label = ""  # e.g. "r2": names this start's trace file
        self.request_extra: dict[str, Any] = {}  # fields added to every request body

    async def start(self, ctx: BenchContext) -> str:
        """Start and return the base URL (``http://127.0.0.1:PORT``) once it serves."""
        raise NotImplementedError

    async def stop(self) -> None:
        for process in reversed(self.processes):
            await asyncio.to_thread(process.stop)
        self.processes.clear()


class KvpushSystem(System):
    mode: ClassVar[str]
    transfer = "gateway"
    first_token_by = "prefill"  # the gateway's default, named: the TTFT breakdown reads it
    eager: ClassVar[bool] = False  # --enforce-eager (the -eager rows; CPU engines always are)
    mps: ClassVar[bool] = False  # --mps on (the -mps rows: P and D share the GPU's SMs)
    kv_checksum: ClassVar[bool] = True  # False: --kv-checksum off (the -unchecked row)
    prefill_workers: ClassVar[int] = 1  # --prefill N
    decode_workers: ClassVar[int] = 1  # --decode N
    local_threshold: ClassVar[int | None] = 0  # None: the gateway's default (not passed)
    routing: ClassVar[str | None] = None  # the gateway's --routing (KVPUSH_ROUTING); None: default

    def __init__(self) -> None:
        super().__init__()
        self.request_extra = {"kvpush_mode": self.mode}

    async def start(self, ctx: BenchContext) -> str:
        """``kvpush up --port 0``: up binds the gateway's port itself (no other process can
        take it between a pick and the bind) and its banner names it."""
        log = ctx.log_dir / f"{self.name}.log"
        offset = log.stat().st_size if log.exists() else 0  # a later repeat appends to it
        process = Process(self.name, self.argv(ctx, 0), log, env=self.environment()).start()
        self.processes.append(process)
        deadline = time.monotonic() + ctx.start_timeout_s
        url = await wait_banner(process, offset, ctx.start_timeout_s)
        await wait_http_ok(f"{url}/ready", self.processes, deadline - time.monotonic())
        return url

    def workers(self, ctx: BenchContext) -> tuple[int, int]:
        """(prefill workers, decode workers) of ``kvpush up`` on ``ctx``'s device."""
        return self.prefill_workers, self.decode_workers

    def environment(self) -> dict[str, str]:
        """Variables added to ``kvpush up``'s environment (its gateway inherits them)."""
        return {"KVPUSH_ROUTING": self.routing} if self.routing else {}

    def argv(self, ctx: BenchContext, port: int) -> list[str]:
        """The ``kvpush up`` command of this system (sets ``trace_file`` when tracing)."""
        argv = [sys.executable, "-m", "kvpush.services.cli", "up", "--model", str(ctx.model_dir)]
        argv += ["--mode", self.mode, "--port", str(port)]
        if self.local_threshold is not None:
            argv += ["--local-threshold", str(self.local_threshold)]
        prefill, decode = self.workers(ctx)
        if (prefill, decode) != (1, 1):
            argv += ["--prefill", str(prefill), "--decode", str(decode)]
        argv += ["--first-token", self.first_token_by]
        argv += ["--log-dir", str(ctx.log_dir / self.name)]
        argv += ["--device", ctx.device, "--load-format", ctx.load_format]
        if ctx.cuda:  # the workers' defaults: each engine as `vllm serve` runs it
            argv += ["--gpus", str(ctx.gpu)]
            argv += ["--gpu-memory-utilization", str(ctx.gpu_memory_utilization)]
            if ctx.decode_gpu_memory_utilization is not None:
                decode_share = str(ctx.decode_gpu_memory_utilization)
                argv += ["--decode-gpu-memory-utilization", decode_share]
        else:  # as vLLM's servers on CPU (vllm_systems.py)
            argv += ["--max-num-seqs", "256"]
        if self.eager:
            argv.append("--enforce-eager")
        if self.mps:
            argv += ["--mps", "on"]
        if not self.kv_checksum:
            argv += ["--kv-checksum", "off"]
        if ctx.trace_dir is not None:
            suffix = f"-{self.run_label}" if self.run_label else ""
            self.trace_file = ctx.trace_dir / f"{self.name}{suffix}.jsonl"
            self.trace_file.unlink(missing_ok=True)
            argv += ["--trace-file", str(self.trace_file)]
        return argv


class KvpushPush(KvpushSystem):
    name = "kvpush-push"
    mode = "push"


class KvpushPull(KvpushSystem):
    name = "kvpush-pull"
    mode = "pull"


class KvpushPushEager(KvpushPush):
    name = "kvpush-push-eager"
    eager = True


class KvpushPullEager(KvpushPull):
    name = "kvpush-pull-eager"
    eager = True


class KvpushPushMps(KvpushPush):
    name = "kvpush-push-mps"
    mps = True


class KvpushPushUnchecked(KvpushPush):
    name = "kvpush-push-unchecked"
    kv_checksum = False


class KvpushRoutedSystem(KvpushSystem):
    """2P2D in push mode under a routing policy: the policy picks each request's mode."""

    mode = "push"
    transfer = "none"  # some requests are served on D by design: nothing to check per request
    prefill_workers = 2
    decode_workers = 2

    def __init__(self) -> None:
        super().__init__()
        self.request_extra = {}  # no kvpush_mode: that would override the policy

    def workers(self, ctx: BenchContext) -> tuple[int, int]:
        """2P2D on CPU (a core each, in turn); 2P1D on a GPU (the three share it)."""
        return (
            (self.prefill_workers, 1) if ctx.cuda else (self.prefill_workers, self.decode_workers)
        )


class KvpushRouted(KvpushRoutedSystem):
    name = "kvpush-routed"
    routing = "routed"
    local_threshold = None  # the default: a cold-start fallback only (0 would mean never LOCAL)


class KvpushRoutedOnePair(KvpushRouted):
    """``kvpush-routed`` as one P and one D (an extra labelled row): on one GPU, where the
    policy keeps prompts LOCAL, the run can give D what a second P's weights and share would
    hold (``--decode-gpu-memory-utilization``; tests/gpu/h200.sh routed-load's D_SHARE)."""

    name = "kvpush-routed-1p1d"
    prefill_workers = 1
    decode_workers = 1

    def workers(self, ctx: BenchContext) -> tuple[int, int]:
        return 1, 1


class KvpushLeastLoaded(KvpushRoutedSystem):
    name = "kvpush-least-loaded"
    routing = "least-loaded"
    local_threshold = 256  # the old default threshold, named so a new default does not move it


ROUTING_SYSTEMS = (KvpushRouted.name, KvpushLeastLoaded.name, KvpushRoutedOnePair.name)

KVPUSH_SYSTEMS: dict[str, type[KvpushSystem]] = {
    cls.name: cls
    for cls in (
        KvpushPush,
        KvpushPull,
        KvpushPushEager,
        KvpushPullEager,
        KvpushPushMps,
        KvpushPushUnchecked,
        KvpushRouted,
        KvpushRoutedOnePair,
        KvpushLeastLoaded,
    )
}
