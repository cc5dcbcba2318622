"""CoreEngineHost: a vLLM engine as ``vllm serve`` runs it — ``AsyncLLM`` with the engine core in
a process of its own (async scheduling and, on CUDA, torch.compile + CUDA graphs by default).

The same face as ``EngineHost`` (``submit``/``abort`` give and end ``RequestHandle``s, the n
answers of a request fanned out here: ``fanout.py``), so the worker service runs either. What
differs is where things run: vLLM's scheduler, the connector's scheduler half and (with the
uniproc executor) the model and the connector's worker half live in the engine-core process,
which steps on its own busy loop; this process holds vLLM's client (input and output
processing, detokenizing, stop strings). P's first token comes back as the request's first
engine output (``kvpush.connector.vllm.engine_core``: kvpush's ``scheduler_cls``), and what
the worker asks of the connector (each rank's side channel, live transfers, KV integrity
counts, a peer to suspect) crosses as ``collective_rpc`` calls to kvpush's
``worker_extension_cls`` (``CoreLink``). The pool's free blocks come from vLLM's scheduler
stats (``kv_cache_usage``, every step), so stats are on, as under ``vllm serve``.

Threading model: ``AsyncLLM`` lives on one asyncio loop on the daemon thread
``kvpush-engine-client``; every public method may be called from any thread and hands its work
to that loop (``call_soon_threadsafe``; queries wait for the answer). Per answer one task reads
``AsyncLLM.generate`` and pushes deltas into the request's handle (``RequestHandle._push`` is
thread-safe). The loop's own state (``_requests``, ``_answers``, ``_tasks``) is touched on it
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from kvpush.connector import ConnectorInfo, EngineLink
from kvpush.services.workers import kv_memory
from kvpush.services.workers.engine import EngineHost
from kvpush.services.workers.engine_config import (
    EngineConfig,
    engine_kwargs,
    vllm_configs,
    wait_for_gate,
)
from kvpush.services.workers.fanout import Answers, AnswersHost
from kvpush.services.workers.handles import EngineOutput

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 30.0


class CoreLink(EngineLink):
    """The connector as a driver of an engine-core process sees it (``EngineLink``'s face): the
    ranks' identities (read at start), live transfers, KV integrity counts and suspects over
    ``collective_rpc`` (any thread but the client's loop: the queries wait for the answer).
    Timing marks and P's first tokens all come on the requests' outputs: none to take here."""

    def __init__(self, host: CoreEngineHost) -> None:
        super().__init__()
        self._host = host
        self.rank_infos: list[ConnectorInfo] = []  # by rank, set once the engine is built

    @property
    def connected(self) -> bool:
        return bool(self.rank_infos)

    @property
    def ranks(self) -> list[ConnectorInfo]:
        return self.rank_infos

    def pending(self) -> int:
        """Transfers some rank's transport still tracks (asks every rank)."""
        return sum(self._host.rpc("kvpush_live_transfers")) if self.connected else 0

    def integrity_counts(self) -> dict[str, int]:
        """Decode: KV integrity outcomes so far (``EngineLink.integrity_counts``): the sum of
        what every rank sent up to the scheduler half, which is that half's count (asks every
        rank; empty on prefill)."""
        totals: Counter[str] = Counter()
        for counts in self._host.rpc("kvpush_integrity_counts") if self.connected else []:
            totals.update(counts or {})
        return dict(totals)

    def suspect_peer(self, address: str) -> None:
        """Tell every rank's decode side (without waiting) that ``address`` may be gone."""
        if self.connected:
            self._host.rpc_nowait("kvpush_suspect_peer", address)


class _FreeBlocks:
    """A vLLM stat logger of the pool's free blocks (``kv_cache_usage`` of each step's
    ``SchedulerStats``; it runs in the client's output handler, on the host's loop)."""

    def __init__(self, host: CoreEngineHost) -> None:
        self.host = host

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> _FreeBlocks:
        return self  # vLLM's StatLoggerFactory: one engine, one logger

    def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
        if scheduler_stats is not None:
            usable = self.host.total_blocks()
            self.host.last_free_blocks = round((1.0 - scheduler_stats.kv_cache_usage) * usable)
            self.host.steps += 1

    def log_engine_initialized(self) -> None:
        return None

    def log(self) -> None:
        return None

    def record_sleep_state(self, *args: Any) -> None:
        return None


class CoreEngineHost(AnswersHost):
    """A vLLM ``AsyncLLM`` with its engine-core process; the module docstring says how."""

    thread_name = "kvpush-engine-client"
    daemon = True
    start_timeout_s = 900.0  # the core process compiles and captures CUDA graphs

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # kvpush's scheduler in the engine-core process sends P's first tokens to D itself
        self.sends_first_tokens = bool(config.kv_transfer_config)
        self.link = CoreLink(self)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # engine request id -> its reader

    # ---- lifecycle ------------------------------------------------------------------------
    def _run(self, report: Callable[[str], None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            if self._built(lambda: loop.run_until_complete(self._build(report))):
                loop.run_forever()
        finally:
            loop.close()

    async def _build(self, report: Callable[[str], None]) -> None:
        cfg = self.config
        started = time.monotonic()
        report("importing vllm")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        imported_s = time.monotonic() - started
        wait_for_gate(cfg, report)  # another engine on the GPU measures its free memory
        kwargs = engine_kwargs(cfg)
        vllm_configs(kwargs, cfg.kv_transfer_config)
        memory_key = kv_memory.key_of(cfg) if cfg.kv_transfer_config else None
        known = kv_memory.remembered(memory_key) if memory_key else None
        if known and kwargs.get("kv_cache_memory_bytes") is None:
            kwargs.update(kv_cache_memory_bytes=known)  # no memory profiling this time
            report(f"KV cache {known / 2**30:.2f} GiB, as the last start found (not profiled)")
        graphs = "eager" if kwargs.get("enforce_eager") else "torch.compile + CUDA graphs"
        report(
            f"vllm imported ({imported_s:.1f} s); starting the engine-core process"
            f" ({graphs if cfg.device == 'cuda' else cfg.device}; loading weights, profiling"
            " memory, compiling and capturing: minutes on a cold cache)"
        )
        try:
            engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**kwargs),
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=[_FreeBlocks(self)],
            )
        except Exception:
            if memory_key and known:  # the remembered size may be what failed: profile next
                kv_memory.forget(memory_key)
            raise
        self._engine = engine
        self._num_blocks = int(engine.vllm_config.cache_config.num_gpu_blocks or 0)
        if cfg.load_format == "dummy" and cfg.dummy_weights == "normal":
            report("dummy weights redrawn: normal(0, 0.02) by parameter name, norms 1")
            await engine.collective_rpc("kvpush_redraw_dummy_weights")
        if cfg.kv_transfer_config:
            infos = await engine.collective_rpc("kvpush_rank_info", timeout=RPC_TIMEOUT_S)
            ranks = [msgspec.convert(info, ConnectorInfo) for info in infos if info is not None]
            self.link.rank_infos = sorted(ranks, key=lambda info: info.rank)
        if memory_key and not known:  # profiled: the next start on this host need not be
            found = await engine.collective_rpc("kvpush_kv_cache_bytes", timeout=RPC_TIMEOUT_S)
            if found and all(found) and len(set(found)) == 1:
                kv_memory.remember(memory_key, found[0], kv_memory.about(cfg))
        self.last_free_blocks = self.total_blocks()
        report(f"engine ready ({time.monotonic() - started:.1f} s, {self.total_blocks()} blocks)")

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request, shut the engine (and its process) down, end the loop."""
        loop = self._loop
        if loop is None or self._thread is None or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout)

    async def _shutdown(self) -> None:
        self._accepting = False
        self._abort_all("abort", "engine stopped")
        for task in list(self._tasks.values()):
            task.cancel()
        try:
            self._engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    # ---- requests -------------------------------------------------------------------------
    def free_blocks(self, timeout: float = 30.0) -> int:
        """Free blocks after the engine's last step (its scheduler stats)."""
        return self.last_free_blocks

    def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Drop the prefix cache; False while any block is in use."""
        return bool(self._wait(self._engine.reset_prefix_cache(), timeout))

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` of kvpush's worker extension: every rank's answer."""
        return list(self._wait(self._engine.collective_rpc(method, args=args), RPC_TIMEOUT_S))

    def rpc_nowait(self, method: str, *args: Any) -> None:
        if self._loop is not None and self._accepting:
            asyncio.run_coroutine_threadsafe(
                self._engine.collective_rpc(method, args=args), self._loop
            )

    def _wait(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        if self._loop is None:
            raise RuntimeError("CoreEngineHost is not running")
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking query from the engine client's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _dispatch(self, command: Callable[[], None]) -> None:
        if not self._accepting or self._loop is None:
            raise RuntimeError("CoreEngineHost is not running")
        self._loop.call_soon_threadsafe(command)

    def _add_answer(self, answers: Answers, engine_id: str, params: Any) -> None:
        self._answers[engine_id] = answers
        assert self._loop is not None
        task = self._loop.create_task(self._read(answers, engine_id, params))
        self._tasks[engine_id] = task

    async def _read(self, answers: Answers, engine_id: str, params: Any) -> None:
        """One answer's outputs from ``AsyncLLM.generate`` into the request's handle."""
        try:
            async for out in self._engine.generate(answers.prompt, params, engine_id):
                if self._answers.get(engine_id) is not answers:  # aborted meanwhile
                    return
                self._route(out)
        except Exception as exc:  # refused by vLLM's input checks, or the engine died
            if self._answers.pop(engine_id, None) is answers:
                log.warning("answer %s failed: %s", engine_id, exc)
                index = answers.live.get(engine_id, 0)
                error = f"rejected: {exc}"
                delta = EngineOutput(
                    engine_id, [], "", "error", error, index=index, sequence_finish_reason="error"
                )
                self._deliver(answers, engine_id, delta)
        finally:
            self._tasks.pop(engine_id, None)

    def _abort_answers(self, engine_ids: list[str]) -> None:
        for engine_id in engine_ids:
            if (task := self._tasks.pop(engine_id, None)) is not None:
                task.cancel()  # vLLM's generate aborts its request when cancelled
        assert self._loop is not None
        self._loop.create_task(self._engine.abort(engine_ids))


def engine_host(config: EngineConfig) -> EngineHost | CoreEngineHost:
    """The host of ``config.engine_core``: a thread of this process, or an engine-core process."""
    if config.engine_core == "process":
        return CoreEngineHost(config)
    if config.engine_core == "thread":
        return EngineHost(config)
    raise ValueError(f"engine_core must be 'process' or 'thread', not {config.engine_core!r}")
