"""vLLM's own systems for ``kvpush bench serve``: the peers kvpush is measured against.

- ``VllmPull`` ("vllm-pull"): ``vllm serve`` P (prefill core) + ``vllm serve`` D (decode core),
  both with vLLM's ``NixlConnector`` (D READs P's blocks), behind ``proxy.py --mode pull``
  (P first with ``max_tokens: 1``, then D with P's ``kv_transfer_params``).
- ``VllmPush`` ("vllm-push"): the same pair with ``NixlPushConnector`` (P WRITEs into blocks D
  registered), behind ``proxy.py --mode push`` (both legs at once, same ``X-Request-Id``).
- ``Aggregated`` ("aggregated"): one ``vllm serve`` without a connector on the prefill core;
  on a GPU ``VllmServe`` ("vllm-serve"), the same under the name users know it by.
- ``<name>-eager``: any of them with ``--enforce-eager`` (extra, labelled rows on a GPU).

On CPU every vLLM server runs with kvpush's engine settings (``workers/config.py``
``engine_config``, ``workers/engine.py`` ``EngineHost``, ``KvpushSystem``'s ``--max-num-seqs
256``):

==========================  ============================================================
dtype                       ``--dtype float32``
eager                       ``--enforce-eager``
block size                  ``--block-size 128``
context                     ``--max-model-len`` = the model's recipe ``max_context`` (4096)
prefix caching              ``--enable-prefix-caching``
sequences                   ``--max-num-seqs 256`` (kvpush: ``--max-num-seqs``)
batched tokens              ``--max-num-batched-tokens 2048`` (what kvpush's engines get: it
                            sets none and builds them with `vllm serve`'s usage context,
                            whose CPU default is 2048 per rank)
seed                        ``--seed 0``
sampling defaults           ``--generation-config vllm`` (kvpush builds SamplingParams from
                            the request only; the model's generation_config is not applied)
stats logging               ``--disable-log-stats`` (kvpush: ``disable_log_stats=True``);
                            ``log_stats=True`` turns it on for checks
access log                  ``--disable-uvicorn-access-log`` (no per-request log line)
usage                       ``--enable-prompt-tokens-details``: the final usage chunk
                            carries ``prompt_tokens_details.cached_tokens``, which shows
                            whether D loaded the prompt's KV or computed it (``checks.py``)
KV cache                    ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB)
executor                    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the uni executor, so the
                            model runs in the EngineCore process like kvpush's in-process
                            engine (``executor="mp"``: vllm-cpu's default multiproc worker)
pinning                     the whole process tree (API server, EngineCore) on the core
                            (``KVPUSH_VLLM_CPUS``, see ``vllm_site/sitecustomize.py``),
                            ``OMP_NUM_THREADS=1``, ``VLLM_CPU_OMP_THREADS_BIND=<core>`` (read
                            by the mp executor only, as in kvpush)
offline                     ``HF_HUB_OFFLINE=1``
connector                   ``kv_role`` producer/consumer, ``kv_buffer_device: cpu``,
                            ``kv_load_failure_policy: recompute`` (as kvpush's connector),
                            ``engine_id`` fixed, NIXL side channel on a free port each
==========================  ============================================================

On CUDA (``--device cuda``) every server runs as its users run it: vLLM's default engine
flags (CUDA graphs, async scheduling, its block size and batch sizes; no ``--enforce-eager``
but in the ``-eager`` rows), plus what this setup needs: ``--dtype bfloat16``, ``--load-format``
as the bench's (dummy for a model built without weights), ``--gpu-memory-utilization`` the
bench's share per engine (twice that for the aggregated one), the context, the seed and
generation config above (the same answers), ``--enable-prompt-tokens-details`` (the checks),
``CUDA_VISIBLE_DEVICES``, no pinning and no ``VLLM_CPU_*``, NIXL buffers on the GPU
(``kv_buffer_device: cuda``); ``vllm-pull-tuned`` adds ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` to
both servers. The servers of one system start one after the other.

Why the uni executor: with vllm-cpu's multiproc executor every step crosses a shared-memory
queue whose readers spin (sched_yield) for 1 s after each read; P's worker then burned 75-80 %
of its core all through D's decode (2-core box, bench model, 1024-token prompt: D's 31 tokens
after the first took 0.52 s instead of 0.26 s; TTFT 626 ms instead of 384 ms) and the
EngineCore spins next to its worker on the same core. Capping the spin breaks
the queue's wake-ups (2 s per step), so the queue is left out instead.

The runtime fixes in ``vllm_site/`` (on ``PYTHONPATH`` of every server): the ``vllm``
distribution name resolves (vllm-cpu), vLLM's NIXL worker cannot move a process off its core,
nixl's UCX progress thread waits ``NIXL_PTHR_DELAY_US`` instead of busy-polling a core, and
every vLLM process dies with its parent.

What stays different by design: each vLLM server has its own API server process (HTTP,
detokenization) on the engine's core; kvpush has one gateway (not pinned) and a worker process
per engine. The proxy, like kvpush's gateway, is not pinned.

Threading model: asyncio; every server and the proxy is a ``Process`` (own process group,
killed on ``stop``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvpush.benchmarks.serve.systems import (
    BenchContext,
    Process,
    System,
    free_port,
    wait_http_ok,
)
from kvpush.services import models

SITE_DIR = Path(__file__).with_name("vllm_site")
NIXL_PTHR_DELAY_US = 1000
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerSpec:
    """One ``vllm serve``: its role name, core, HTTP port and connector."""

    role: str  # prefill | decode | engine
    core: int
    port: int = field(default_factory=free_port)
    kv_transfer_config: dict[str, Any] | None = None
    side_channel_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def max_model_len(model_dir: Path) -> int:
    """The context kvpush's workers use: the recipe's ``max_context``, else 4096."""
    recipe = (models.read_stamp(model_dir) or {}).get("recipe") or {}
    return int(recipe.get("max_context") or 4096)


def vllm_command() -> list[str]:
    """``vllm`` next to this interpreter (so ``pgrep -f "vllm serve"`` finds the servers)."""
    script = Path(sys.executable).with_name("vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_argv(
    ctx: BenchContext, spec: ServerSpec, log_stats: bool, eager: bool = False
) -> list[str]:
    """One ``vllm serve`` command. On CUDA only what a user of this setup must give (model,
    port, the GPU share of engines side by side, dummy weights, the context, the connector)
    and what the checks read (cached prompt tokens); vLLM's own defaults for the rest (CUDA
    graphs, async scheduling, block size, batch sizes). ``eager``: ``--enforce-eager`` (the
    ``-eager`` rows). On CPU: the table of the module docstring (kvpush's engine settings)."""
    argv = [*vllm_command(), "serve", str(ctx.model_dir), "--served-model-name", ctx.served_name]
    argv += ["--host", HOST, "--port", str(spec.port), "--load-format", ctx.load_format]
    argv += ["--max-model-len", str(max_model_len(ctx.model_dir)), "--seed", "0"]
    argv += ["--generation-config", "vllm", "--disable-uvicorn-access-log"]
    argv.append("--enable-prompt-tokens-details")  # usage.prompt_tokens_details.cached_tokens
    if spec.kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
    if eager or not ctx.cuda:
        argv.append("--enforce-eager")
    if ctx.cuda:  # the aggregated engine gets the GPU share of a P and a D
        share = ctx.gpu_memory_utilization * (2 if spec.role == "engine" else 1)
        return [*argv, "--dtype", "bfloat16", "--gpu-memory-utilization", f"{share:g}"]
    argv += ["--dtype", "float32", "--block-size", "128"]
    argv += ["--enable-prefix-caching", "--max-num-seqs", str(MAX_NUM_SEQS)]
    argv += ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]
    if not log_stats:
        argv.append("--disable-log-stats")
    return argv


def serve_env(
    spec: ServerSpec,
    *,
    executor: str,
    fix_affinity: bool,
    nixl_pthr_delay_us: int | None,
    gpu: int | None = None,
) -> dict[str, str]:
    """The environment of one ``vllm serve``; ``gpu``: a CUDA engine on that GPU (no CPU
    pinning or CPU cache settings: its model runs on the GPU; async scheduling as shipped)."""
    path = os.environ.get("PYTHONPATH")
    if gpu is not None:
        env = {
            "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else ""),
            "HF_HUB_OFFLINE": "1",
            "CUDA_VISIBLE_DEVICES": str(gpu),
            "KVPUSH_VLLM_DIE_WITH_PARENT": "1",
            "NIXL_LOG_LEVEL": "WARN",
        }
        if executor == "uni":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if spec.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
        return env
    env = {
        "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else ""),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": str(spec.core),
        "OMP_NUM_THREADS": "1",
        "KVPUSH_VLLM_CPUS": str(spec.core),
        "KVPUSH_VLLM_AFFINITY_GUARD": "1" if fix_affinity else "0",
        "KVPUSH_VLLM_DIE_WITH_PARENT": "1",
        "NIXL_LOG_LEVEL": "WARN",
    }
    if executor == "uni":  # vllm-cpu forces the multiproc executor unless this is 0
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if nixl_pthr_delay_us is not None:
        env["KVPUSH_NIXL_PTHR_DELAY_US"] = str(nixl_pthr_delay_us)
    if spec.side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    return env


def nixl_config(
    connector: str, role: str, engine_id: str, buffer_device: str = "cpu"
) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_buffer_device": buffer_device,
        "kv_load_failure_policy": "recompute",
    }


class VllmSystem(System):
    """Shared start/stop of ``vllm serve`` processes (and the proxy) for vLLM's systems.

    Keyword options exist for the checks of the runtime fixes; the bench uses the defaults.
    After ``start``: ``servers`` (role -> (spec, process)) and ``start_s`` (role -> seconds
    until it answered ``/health``; "total" for the whole system).
    """

    eager: ClassVar[bool] = False  # --enforce-eager on CUDA too (the -eager rows)

    def __init__(
        self,
        *,
        log_stats: bool = False,
        executor: str = "uni",
        fix_affinity: bool = True,
        nixl_pthr_delay_us: int | None = NIXL_PTHR_DELAY_US,
    ) -> None:
        super().__init__()
        if executor not in ("uni", "mp"):
            raise ValueError(f"executor must be uni or mp, not {executor!r}")
        self.log_stats, self.executor, self.fix_affinity = log_stats, executor, fix_affinity
        self.nixl_pthr_delay_us = nixl_pthr_delay_us
        self.servers: dict[str, tuple[ServerSpec, Process]] = {}
        self.start_s: dict[str, float] = {}
        self.extra_env: dict[str, dict[str, str]] = {}  # role -> more environment

    def _say(self, ctx: BenchContext, message: str) -> None:
        if callable(ctx.say):
            ctx.say(f"[{self.name}] {message}")

    async def _start_servers(self, ctx: BenchContext, specs: list[ServerSpec]) -> None:
        """Start every server at once (each on its core; on CUDA one after the other: vLLM
        sizes its KV cache from the memory free while it profiles); return when all serve."""
        started = time.monotonic()

        async def ready(spec: ServerSpec, process: Process) -> None:
            since = started if not ctx.cuda else time.monotonic()  # cuda: from its own start
            await wait_http_ok(f"{spec.url}/health", [process], ctx.start_timeout_s)
            self.start_s[spec.role] = time.monotonic() - since
            self._say(ctx, f"{spec.role} ready in {self.start_s[spec.role]:.1f} s")

        for spec in specs:
            log = ctx.log_dir / f"{self.name}-{spec.role}.log"
            env = serve_env(
                spec,
                executor=self.executor,
                fix_affinity=self.fix_affinity,
                nixl_pthr_delay_us=self.nixl_pthr_delay_us,
                gpu=ctx.gpu if ctx.cuda else None,
            )
            env.update(self.extra_env.get(spec.role, {}))
            argv = serve_argv(ctx, spec, self.log_stats, self.eager)
            process = Process(f"{self.name}-{spec.role}", argv, log, env).start()
            self.processes.append(process)
            self.servers[spec.role] = (spec, process)
            where = f"GPU {ctx.gpu}" if ctx.cuda else f"core {spec.core}"
            self._say(ctx, f"{spec.role}: vllm serve on {where}, port {spec.port}")
            if ctx.cuda:  # vLLM sizes its KV cache while it profiles: one engine at a time
                await ready(spec, process)

        if not ctx.cuda:
            await asyncio.gather(*(ready(*self.servers[s.role]) for s in specs))

    async def _start_proxy(self, ctx: BenchContext, mode: str, extra: list[str]) -> str:
        prefill, decode = self.servers["prefill"][0], self.servers["decode"][0]
        port = free_port()
        argv = [sys.executable, "-m", "kvpush.benchmarks.serve.proxy", "--mode", mode]
        argv += ["--prefill", prefill.url, "--decode", decode.url, "--port", str(port), *extra]
        log = ctx.log_dir / f"{self.name}-proxy.log"
        process = Process(f"{self.name}-proxy", argv, log).start()
        self.processes.append(process)
        url = f"http://{HOST}:{port}"
        await wait_http_ok(f"{url}/health", [process], ctx.start_timeout_s)
        return url

    async def start(self, ctx: BenchContext) -> str:
        started = time.monotonic()
        try:
            url = await self._start(ctx)
        except BaseException:
            await self.stop()
            raise
        self.start_s["total"] = time.monotonic() - started
        self._say(ctx, f"serving at {url} ({self.start_s['total']:.1f} s)")
        return url

    async def _start(self, ctx: BenchContext) -> str:
        raise NotImplementedError

    async def stop(self) -> None:
        await super().stop()
        self.servers.clear()


class VllmPull(VllmSystem):
    name = "vllm-pull"
    transfer = "proxy"
    connector: ClassVar[str] = "NixlConnector"

    def _pair(self, ctx: BenchContext) -> list[ServerSpec]:
        specs = []
        for role, core, kv_role in (
            ("prefill", ctx.prefill_core, "kv_producer"),
            ("decode", ctx.decode_core, "kv_consumer"),
        ):
            port = free_port()
            engine_id = f"{self.name}-{role}-{port}"
            kv = nixl_config(self.connector, kv_role, engine_id, "cuda" if ctx.cuda else "cpu")
            specs.append(ServerSpec(role, core, port, kv, side_channel_port=free_port()))
        return specs

    async def _start(self, ctx: BenchContext) -> str:
        await self._start_servers(ctx, self._pair(ctx))
        return await self._start_proxy(ctx, "pull", [])


class VllmPullTuned(VllmPull):
    """vLLM's pull with its READ on a GPU lane: UCX's cuda_ipc does GET zero-copy only when
    asked (without it the READ fell back to TCP on the H200, docs/benchmarks/gpu.md)."""

    name = "vllm-pull-tuned"

    async def _start(self, ctx: BenchContext) -> str:
        tuned = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
        self.extra_env["prefill"] = dict(tuned)
        self.extra_env["decode"] = dict(tuned)
        return await super()._start(ctx)


class VllmPush(VllmPull):
    name = "vllm-push"
    connector: ClassVar[str] = "NixlPushConnector"

    async def _start(self, ctx: BenchContext) -> str:
        specs = self._pair(ctx)
        # P's request id is then exactly cmpl-<X-Request-Id>, which the proxy hands D as
        # remote_request_id before P has answered (D's lease heartbeats name it)
        self.extra_env["prefill"] = {"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
        await self._start_servers(ctx, specs)
        prefill = specs[0]
        assert prefill.kv_transfer_config is not None
        extra = ["--prefill-engine-id", prefill.kv_transfer_config["engine_id"]]
        extra += ["--prefill-side-channel", f"{HOST}:{prefill.side_channel_port}"]
        return await self._start_proxy(ctx, "push", extra)


class Aggregated(VllmSystem):
    name = "aggregated"
    disaggregated = False

    async def _start(self, ctx: BenchContext) -> str:
        spec = ServerSpec("engine", ctx.prefill_core)
        await self._start_servers(ctx, [spec])
        return spec.url


class VllmServe(Aggregated):
    """The aggregated engine on a GPU, as `vllm serve` runs it (its default flags)."""

    name = "vllm-serve"


def eager_variant(cls: type[VllmSystem]) -> type[VllmSystem]:
    """The same system with ``--enforce-eager``, named ``<name>-eager``."""
    return type(f"{cls.__name__}Eager", (cls,), {"name": f"{cls.name}-eager", "eager": True})


_PLAIN = (VllmPull, VllmPullTuned, VllmPush, Aggregated, VllmServe)
_EAGER = tuple(eager_variant(cls) for cls in (VllmPull, VllmPullTuned, VllmPush, VllmServe))
VLLM_SYSTEMS: dict[str, type[VllmSystem]] = {cls.name: cls for cls in (*_PLAIN, *_EAGER)}
