"""kvpush up: the embedded default stack in one command.

Starts, in order: nats-server (embedded, or --nats-url URL for an external one), the model (the tiny
random-weight model, built once into the kvpush cache, or --model DIR), --prefill N prefill and
--decode N decode workers as child processes, pinned to the cores in turn (P then D: with one
of each on two cores, P on core 0 and D on core 1; with --tp N a worker has N ranks, a process
each, and N cores), and the OpenAI-compatible gateway on 127.0.0.1:8000 (--port 0: a free
port, the one in the URL printed). The gateway's port and each worker's metrics port are bound
by up itself before anything starts, their sockets handed down (``up_sockets``): a port in use
fails at once, and no engine's ephemeral port can take one meanwhile. A line is printed for
each worker once it is ready (its first heartbeat), then
the URL and a curl example. A worker that exits is started again (after 1 s, doubled for each
restart in a row, up to 30 s) while the others serve. Ctrl-C (SIGINT) or SIGTERM stops
everything: the gateway first, then the workers (each drains: requests in flight finish), then
nats-server. A second Ctrl-C kills at once. Logs of the children: --log-dir (default
~/.cache/kvpush/logs).

This module owns the stack's child processes (each an ``up_child.Child``) and the order they
start and stop in. Threading model: one asyncio loop on the main thread (heartbeat
subscription, child polling, HTTP readiness, signals). Children run in sessions of their own,
so a terminal's Ctrl-C reaches only `up`, which orders the shutdown; PR_SET_PDEATHSIG sends
them SIGTERM should `up` die.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvpush.connector import Bus, BusConfig
from kvpush.schemas import subjects
from kvpush.schemas.messages import WorkerHeartbeat
from kvpush.services import up_config
from kvpush.services.mps import MpsDaemon
from kvpush.services.natsd import EmbeddedNats
from kvpush.services.settings import ConfigError, apply_gil_switch
from kvpush.services.up_child import Child, gpus_started_together
from kvpush.services.up_config import UpConfig
from kvpush.services.up_sockets import (
    close_all,
    http_url,
    listen,
    listen_for_worker_metrics,
    port_of,
    reachable_host,
    worker_metrics_host,
)
from kvpush.services.workers import config as worker_config

BANNER_URL = re.compile(r"kvpush is up: (http://\S+:\d+)/v1")
"""The gateway's URL in ``Stack.banner``'s first line: how a caller of ``kvpush up --port 0``
learns the port up bound."""
RESTART_BACKOFF_S = 1.0  # a worker that exited starts again after this long ...
RESTART_MAX_BACKOFF_S = 30.0  # ... doubled per restart in a row, up to this
RESTART_RESET_S = 60.0  # a worker that ran this long starts again after the first backoff


def say(message: str) -> None:
    print(f"[kvpush up] {message}", file=sys.stderr, flush=True)


class Stack:
    """nats-server + workers + gateway; lifecycle setup -> start -> cleanup."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.nats: EmbeddedNats | None = None
        self.nats_url = config.nats_url or ""
        self.model_dir = config.model_dir or ""
        self.model_name = ""
        self.workers: list[Child] = []
        self.gateway: Child | None = None
        self.gate_dir = ""  # the gates of engines waiting for their GPU (_gate)
        self.mps: MpsDaemon | None = None  # --mps on
        self.listener: socket.socket | None = None  # the gateway's, bound first (setup)
        self.port = config.port  # the gateway's: once bound, the real one (--port 0: any)
        self.metrics_sockets: list[socket.socket] = []  # the workers', one each (_plan)

    @property
    def children(self) -> list[Child]:
        return [*self.workers, *([self.gateway] if self.gateway else [])]

    async def setup(self) -> None:
        cfg = self.config
        self.listener = listen(cfg.host, cfg.port)  # first: a port in use stops nothing started
        self.port = port_of(self.listener)
        if not self.nats_url:
            self.nats = EmbeddedNats()
            self.nats_url = await asyncio.to_thread(self.nats.start)
            say(f"nats-server (embedded, JetStream): {self.nats_url}")
        else:
            say(f"nats-server: {self.nats_url}")
        if not self.model_dir:
            say("model: the tiny random-weight model (built on first use)")
            path = await asyncio.to_thread(worker_config.default_model_dir, say)
            self.model_dir = str(path)
        self.model_dir = str(Path(self.model_dir).expanduser().resolve())
        self.model_name = worker_config.model_name_of(self.model_dir)
        say(f"model {self.model_name}: {self.model_dir}")
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        if cfg.mps == "on" and worker_config.resolve_device(cfg.device) == "cuda":
            self.mps = MpsDaemon()
            os.environ.update(await asyncio.to_thread(self.mps.start))  # children: clients
            say(f"MPS: the engines on a GPU share its SMs (daemon in {self.mps.folder})")

    def _plan(self) -> None:
        cfg = self.config
        cores = sorted(os.sched_getaffinity(0))
        common = ["--nats-url", self.nats_url, "--model", self.model_dir]
        if cfg.trace_file:
            common += ["--trace-file", str(Path(cfg.trace_file).resolve())]
        cli = [sys.executable, "-m", "kvpush.services.cli"]
        # an external NATS may be shared: make this stack's worker ids unique on it
        suffix = "" if self.nats is not None else f"-{os.getpid()}"
        metrics_host = worker_metrics_host()
        roles = [("prefill", i) for i in range(cfg.prefill)]
        roles += [("decode", i) for i in range(cfg.decode)]
        first = 0
        gpus = cfg.gpu_list()
        cuda = worker_config.resolve_device(cfg.device) == "cuda"
        for n, (role, i) in enumerate(roles):
            # a worker gets one core per rank, in turn, wrapping around; on a GPU host (the
            # model runs on the GPU, the cores feed it) an even share of the cores
            tp = cfg.tp_of(role)
            width = max(tp, len(cores) // len(roles)) if cuda else tp
            mine = sorted({cores[(first + k) % len(cores)] for k in range(width)})
            first += width
            name, cpus = f"{role}-{i}{suffix}", ",".join(map(str, mine))
            argv = [*cli, role, *common, "--id", name, "--cpus", cpus]
            if tp > 1:
                argv += ["--tp", str(tp)]
            argv += ["--device", cfg.device]
            gpu = cfg.gpu_of(n) if cuda and gpus else None
            if gpu is not None:
                argv += ["--gpu", str(gpu), "--gpu-memory-utilization", str(cfg.gpu_share(n))]
            for key in up_config.PASSED_TO_WORKERS:  # as given (None: not given; 0 is a value)
                if getattr(cfg, key) is not None:
                    argv += [up_config.WORKER[key].flags[0], str(getattr(cfg, key))]
            argv += [f"--engine-arg={flag}" for flag in cfg.engine_args_of(role)]
            # vLLM's vllm:* engine metrics of this worker, on a socket up holds (restarts too)
            metrics = listen_for_worker_metrics(metrics_host)
            self.metrics_sockets.append(metrics)
            argv += ["--metrics-fd", str(metrics.fileno())]
            log_path = Path(cfg.log_dir) / f"{name}.log"
            child = Child(name, argv, log_path, mine, gpu, pass_fds=(metrics.fileno(),))
            base = http_url(reachable_host(metrics_host), port_of(metrics))
            child.metrics_url = f"{base}/metrics"
            self.workers.append(child)
        options = cfg.gateway_flags(self.port)
        # it serves on the socket setup bound (without one, a plan alone: it binds --port)
        fds = (self.listener.fileno(),) if self.listener is not None else ()
        options += [arg for fd in fds for arg in ("--listen-fd", str(fd))]
        argv = [*cli, "gateway", *common, *options]
        self.gateway = Child("gateway", argv, Path(cfg.log_dir) / "gateway.log", pass_fds=fds)

    async def start(self) -> None:
        """Start every child and return once the gateway answers ``/ready``."""
        cfg = self.config
        self._plan()
        waiting = {w.name: w for w in self.workers}  # until its first heartbeat

        async def on_heartbeat(subject: str, message: object) -> None:
            if isinstance(message, WorkerHeartbeat) and message.worker_id in waiting:
                child = waiting.pop(message.worker_id)
                child.ready_s = time.monotonic() - child.started_at
                say(
                    f"  {child.name} ready (cores {_cores(child.cores)}, "
                    f"{child.ready_s:.1f} s, {message.total_blocks} KV blocks)"
                )

        bus = await Bus.connect(BusConfig.from_env(self.nats_url, "kvpush-up"))
        try:
            await bus.subscribe(subjects.heartbeats(), on_heartbeat)
            await bus.flush()
            say(
                f"starting {cfg.prefill} prefill + {cfg.decode} decode worker(s) and the "
                f"gateway (logs in {cfg.log_dir}); engines take a few seconds each"
            )
            # vLLM sizes its KV cache from the GPU memory free while it profiles: two engines
            # profiling one GPU at once starve each other, so a GPU's engines take it in turn,
            # but where each remembers its KV size from a start before (no profiling)
            together = gpus_started_together(self.workers)
            if together:
                say(f"  GPU {_cores(sorted(together))}: every engine's KV size is known from a"
                    " start before: its engines start at once")  # fmt: skip
            self._gate(together)
            for child in self.children:  # a gated engine imports vLLM while it waits
                child.start()
            started = time.monotonic()
            next_note = started + 15.0
            while waiting:
                busy = {c.gpu for c in self.workers if not c.gated and c.name in waiting}
                for child in self.workers:
                    if child.gated and child.gpu not in busy:
                        busy.add(child.gpu)
                        child.open_gate()
                self._check_children()
                now = time.monotonic()
                # each engine gets the whole limit: a GPU's engines take it one after another
                last = max([started, *(c.started_at for c in self.workers if c.proc is not None)])
                if now - last > cfg.start_timeout_s:
                    raise RuntimeError(
                        f"workers not ready after {cfg.start_timeout_s:.0f} s: {', '.join(waiting)}"
                    )
                if now > next_note:
                    doing = ", ".join(f"{n} ({c.phase()})" for n, c in waiting.items())
                    say(f"  still starting ({now - started:.0f} s): {doing}")
                    next_note = now + 15.0
                await asyncio.sleep(0.2)
        finally:
            await bus.close()
        await self._wait_gateway()

    def _gate(self, together: set[int]) -> None:
        """Every engine but the first on a GPU waits for its turn: a file of ``gate_dir`` its
        worker's ``--start-after`` names, made once the engine before it is ready."""
        seen: set[int] = set()
        for child in self.workers:
            if child.gpu is None or child.gpu in together:
                continue
            if child.gpu not in seen:  # the GPU's first engine: its turn at once
                seen.add(child.gpu)
                continue
            if not self.gate_dir:
                self.gate_dir = tempfile.mkdtemp(prefix="kvpush-up-")
            child.gate = Path(self.gate_dir) / f"{child.name}.turn"
            child.argv += ["--start-after", str(child.gate)]

    async def _wait_gateway(self) -> None:
        assert self.gateway is not None
        cfg = self.config
        url = f"{http_url(reachable_host(cfg.host), self.port)}/ready"
        deadline = time.monotonic() + 60.0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while time.monotonic() < deadline:
                self._check_children()
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(url) as response:
                        if response.status == 200:
                            self.gateway.ready_s = time.monotonic() - self.gateway.started_at
                            say(f"  gateway ready on {cfg.host}:{self.port}")
                            return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"the gateway did not answer {url} with 200 in 60 s")

    def _check_children(self) -> None:
        for child in self.children:
            if child.exited is not None:
                raise RuntimeError(
                    f"{child.name} exited with status {child.exited}; "
                    f"the end of {child.log_path}:\n{child.tail()}"
                )

    def banner(self) -> str:
        cfg = self.config
        base = http_url(cfg.host, self.port)
        body = f'{{"model": "{self.model_name}", "prompt": "Hello", "max_tokens": 16}}'
        lines = [
            f"kvpush is up: {base}/v1 (model {self.model_name}, mode {cfg.mode.value}). Try:",
            f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' \\",
            f"    -d '{body}'",
            f"TTFT waterfalls of recent requests: {base}/dashboard   metrics: {base}/metrics",
            "engine metrics (vllm:*): "
            + ", ".join(f"{w.name} {w.metrics_url}" for w in self.workers),
        ]
        if cfg.trace_file:
            lines.append(
                f"Spans go to {cfg.trace_file}: `kvpush ttft {cfg.trace_file} --png w.png`"
            )
        return "\n".join([*lines, "Ctrl-C stops everything."])

    async def watch(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or the gateway exits on its own (1). A worker that
        fails (a status other than 0: killed, crashed) is reported and started again (a new
        epoch: its peers and the gateway released what it held), after ``RESTART_BACKOFF_S``
        doubled for each restart in a row that did not last ``RESTART_RESET_S``; one that
        stopped cleanly (drained on SIGTERM: status 0) is reported and left stopped."""
        due: dict[str, float] = {}  # worker -> when to start it again
        reported: set[int] = set()  # processes whose end was reported
        while not stop.is_set():
            if self.gateway is not None and self.gateway.exited is not None:
                say(f"gateway exited with status {self.gateway.exited}")
                return 1
            now = time.monotonic()
            for child in self.workers:
                proc = child.proc
                if child.exited is None or proc is None or proc.pid in reported:
                    continue
                reported.add(proc.pid)
                if child.exited == 0:
                    say(f"{child.name} exited with status 0")
                    continue
                if now - child.started_at > RESTART_RESET_S:
                    child.restarts = 0
                backoff = min(RESTART_BACKOFF_S * 2**child.restarts, RESTART_MAX_BACKOFF_S)
                due[child.name] = now + backoff
                say(f"{child.name} exited with status {child.exited}; starting it again in"
                    f" {backoff:.0f} s; the end of {child.log_path}:\n{child.tail()}")  # fmt: skip
            for child in self.workers:
                if child.name in due and now >= due[child.name]:
                    del due[child.name]
                    child.restarts += 1
                    child.start()
                    say(f"{child.name} started again (restart {child.restarts})")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return 0

    async def cleanup(self, force: asyncio.Event) -> None:
        """Gateway, then workers (they drain), then nats-server; SIGKILL what hangs."""
        if any(c.exited is None for c in self.children):
            say("stopping: gateway, then workers (they finish what is in flight)")
        await self._stop([self.gateway] if self.gateway else [], 15.0, force)
        close_all([self.listener])  # connections are refused now, not left waiting
        await self._stop(self.workers, self.config.stop_timeout_s, force)
        close_all(self.metrics_sockets)
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        if self.gate_dir:
            shutil.rmtree(self.gate_dir, ignore_errors=True)
        if self.mps is not None:
            await asyncio.to_thread(self.mps.stop)
        say("stopped")

    async def _stop(self, children: list[Child], timeout_s: float, force: asyncio.Event) -> None:
        live = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in live:
            assert child.proc is not None
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(c.exited is None for c in live):
            if force.is_set() or time.monotonic() > deadline:
                for child in live:
                    if child.exited is None and child.proc is not None:
                        say(f"  {child.name} did not stop: killing it")
                        child.proc.kill()
                        child.proc.wait()
                break
            await asyncio.sleep(0.1)
        for child in live:
            say(f"  {child.name} stopped (status {child.exited})")


async def run(config: UpConfig) -> int:
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    stack = Stack(config)
    status = 0
    try:
        await stack.setup()
        starting = asyncio.create_task(stack.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if starting.done():
            starting.result()  # raises a start failure
            print(stack.banner(), flush=True)
            status = await stack.watch(stop)
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
    except Exception as exc:
        say(f"failed: {exc}")
        status = 1
    finally:
        await stack.cleanup(force)
    return status


def main(args: argparse.Namespace) -> int:
    """``kvpush up`` (exit 2 and one line on an unusable setting)."""
    try:
        config = UpConfig.from_args(args)
        apply_gil_switch()  # its children read the same variable: refused here, once
    except ConfigError as exc:
        say(f"configuration: {exc}")
        return 2
    return asyncio.run(run(config))


def _cores(cores: list[int] | None) -> str:
    return ",".join(map(str, cores)) if cores else "-"
